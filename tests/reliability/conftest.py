"""Fixtures of the reliability suite (docs/reliability.md): sizes, the tiny model, a shared
`vx serve` checked after every test, and the one-line figures each goal prints.

Sizes: every goal test takes the `size` fixture, parametrized "ci" (runs in `make test`) and
"stress" (marked `stress`, runs in `make stress`); each test looks its numbers up in `SIZES`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from tests.reliability.harness import FIGURES as _FIGURES, Served, poll, settled

#: Per goal: the CI tier (2 busy cores, a few minutes in all) and the full stress tier.
SIZES: dict[str, dict[str, dict[str, float]]] = {
    "G1": {"ci": {"streams": 16, "seconds": 10}, "stress": {"streams": 64, "seconds": 60}},
    "G2": {"ci": {"streams": 48, "plain": 12}, "stress": {"streams": 200, "plain": 50}},
    "G3": {"ci": {"fuzz": 960, "valid_streams": 4}, "stress": {"fuzz": 5000, "valid_streams": 32}},
    "G4": {"ci": {"streams": 16}, "stress": {"streams": 32}},
    "G7": {"ci": {"streams": 8}, "stress": {"streams": 32}},
    "G8": {"ci": {"slow": 4, "healthy": 4}, "stress": {"slow": 16, "healthy": 16}},
    "G9": {"ci": {"poison": 12, "healthy": 8}, "stress": {"poison": 100, "healthy": 32}},
    "G11": {
        "ci": {"messages": 20_000, "kills": 8},
        "stress": {"messages": 1_000_000, "kills": 200},
    },
    "G12": {"ci": {"term": 2, "kill": 1}, "stress": {"term": 20, "kill": 5}},
}

#: Poison seeds for G9 (VX_TEST_POISON on the shared server).
ENGINE_POISON_SEED = 6661
WORKER_POISON_SEED = 6662

FIGURES_PATH = os.environ.get("VX_RELIABILITY_FIGURES", "/tmp/vx-reliability-figures.txt")


@pytest.fixture(params=["ci", pytest.param("stress", marks=pytest.mark.stress)])
def size(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sized(goal: str, size: str) -> dict[str, float]:
    return SIZES[goal][size]


def figure(line: str) -> None:
    """Record a goal's one-line figure: shown in the terminal summary and appended to a file."""
    _FIGURES.append(line)
    with open(FIGURES_PATH, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:limit] if text else type(e).__name__


@contextlib.contextmanager
def checked_figure(line: str) -> Iterator[None]:
    """Record a goal's figure `line` (formatted from measured values) only once its checks, the
    asserts in the `with` block, have passed. If one fails, "FAIL <line> | <the failure>" is
    recorded instead and the failure propagates: a failing run never prints a passing line."""
    try:
        yield
    except Exception as e:
        figure(f"FAIL {line} | {_first_line(e)}")
        raise
    figure(line)


_FIGURES_AT_SETUP = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A goal that fails before it could record its figure (a start-up or an early check), or
    in a fixture's checks after it (teardown: the shared server's, a tree's leftovers), still
    prints a line, starting "FAIL"."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.stash[_FIGURES_AT_SETUP] = len(_FIGURES)
    if not report.failed or call.excinfo is None:
        return
    recorded = len(_FIGURES) > item.stash.get(_FIGURES_AT_SETUP, len(_FIGURES))
    if report.when != "call" or not recorded:
        figure(f"FAIL {item.name} ({report.when}): {_first_line(call.excinfo.value)}")


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.models import SERVED, make_tiny_model

    # 8,192 positions: G8's stalled streams need more output than loopback's socket buffers hold
    # (the shared server caps requests at 1,024), and G7's long streams must outlast the drain
    # budget however fast the fused step makes the tiny model.
    # SERVED: bf16 weights and head size 32, so the servers run the default path (the fused
    # CPU step, the LM head's C argmax).
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("reliability-tiny"),
            arch="llama",
            max_position_embeddings=8192,
            **SERVED,
        )
    )


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("reliability-logs"))


@pytest.fixture(scope="session")
def shared_server(tiny_model: str, logs: str) -> Iterator[Served]:
    """One server for the goals that do not kill anything (G1, G3, G8, G9, G13)."""
    server = Served(
        tiny_model,
        ("--stall-timeout", "2", "--max-model-len", "1024"),
        env={"VX_TEST_POISON": f"engine:{ENGINE_POISON_SEED},worker:{WORKER_POISON_SEED}"},
        log_dir=logs,
    )
    with server:
        yield server
        code = server.stop()
        assert code == 0, server.log()
        assert poll(lambda: not server.survivors(), 10), server.survivors()
        assert server.leftover_shm() == set()


@pytest.fixture
def shared(shared_server: Served) -> Iterator[Served]:
    """The shared server, checked after the test: balanced, KV self-check ok, idle, its
    front's fds and the tree's shared memory back to where the test found them."""
    assert shared_server.proc is not None and shared_server.proc.poll() is None
    settled(shared_server)
    before = shared_server.snapshot()
    yield shared_server
    settled(shared_server)
    assert poll(lambda: shared_server.snapshot().fds <= before.fds, 10), (
        f"fds {shared_server.snapshot().fds} > {before.fds}"
    )
    assert shared_server.snapshot().shm == before.shm
    assert shared_server.survivors() == shared_server.pids  # nothing died
