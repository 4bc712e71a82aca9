"""The launcher's supervisor (vx/launch.py): one cause named from every sign of a death.

The real deaths are in tests/reliability/test_clean_death.py; this pins the naming rules on
their own: a child killed by a signal is the cause whatever arrived first; else the engine's
report, with the first child's exit status; a report waits for an exit at most SETTLE_S.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from vx.launch import SETTLE_S, _Supervisor, describe_exit

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@dataclass
class _Proc:
    name: str
    pid: int


WORKER, ENGINE = _Proc("vx-worker0.0", 11), _Proc("vx-engine0", 12)


def test_describe_exit() -> None:
    assert describe_exit(WORKER, -9) == "vx-worker0.0 (pid 11) was killed by SIGKILL"  # type: ignore[arg-type]
    assert describe_exit(ENGINE, 1) == "vx-engine0 (pid 12) exited with code 1"  # type: ignore[arg-type]


async def _cause(*signs: tuple[str, Any]) -> tuple[str, float]:
    sup = _Supervisor()
    for kind, value in signs:
        if kind == "exit":
            sup.child_exited(*value)
        else:
            sup.engine_failed(*value)
    t0 = time.monotonic()
    with anyio.fail_after(5):
        cause = await sup.wait_cause()
    return cause, time.monotonic() - t0


async def test_a_killed_child_is_the_cause_whatever_came_first() -> None:
    cause, _ = await _cause(("report", ("engine 0: a worker process died", 0)),
                            ("exit", (ENGINE, 1)), ("exit", (WORKER, -9)))  # fmt: skip
    assert cause == "vx-worker0.0 (pid 11) was killed by SIGKILL"


async def test_a_report_names_the_cause_with_the_first_exit() -> None:
    cause, waited = await _cause(("exit", (ENGINE, 1)),
                                 ("report", ("engine 0: worker (pid 11) stuck", 0)))  # fmt: skip
    assert cause == "engine 0: worker (pid 11) stuck (vx-engine0 (pid 12) exited with code 1)"
    assert waited < SETTLE_S  # an exit was there: no wait


async def test_a_report_alone_waits_for_an_exit_at_most_settle_s() -> None:
    sup = _Supervisor()
    sup.engine_failed("engine 0: closed its output ring", 7)
    t0 = time.monotonic()
    with anyio.fail_after(5):
        cause = await sup.wait_cause()
    assert cause == "engine 0: closed its output ring"
    assert SETTLE_S - 0.05 <= time.monotonic() - t0 < SETTLE_S + 1.0
    assert sup.report_exit_code == 7
