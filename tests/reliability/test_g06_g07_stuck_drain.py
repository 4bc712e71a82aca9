"""G6 stuck worker and G7 drain on SIGTERM.

G6: SIGSTOP the worker under streams with `--step-timeout 3`: the EngineCore's step deadline
declares it stuck, /health turns 503 within the deadline (plus a second), every stream ends with
an error event that says what happened, and the tree is torn down (the stopped worker killed).

G7: SIGTERM under short and long streams with `--drain-timeout D`: /ready 503 at once (/health,
liveness, stays 200 while the tree drains), a new
request gets 503 with Retry-After (not a refused connection), the short streams finish cleanly,
the long ones (8,000 tokens: more than the tiny model makes in D) are cut by the deadline: at
least one, each with a terminal error event that reaches the client between D and D + 2 s after
the signal, as many as the front logs it failed; the front exits 0 within D + 5 s, and nothing
is left behind. With `--drain-timeout 0` a busy server exits within 4 s, every stream ended by
an error event.
"""

from __future__ import annotations

import os
import re
import signal
import time

import anyio
import httpx
import pytest

from tests.reliability.conftest import checked_figure, sized
from tests.reliability.harness import MODEL_NAME, Served, poll
from tests.reliability.streams import StreamRecord, client_for, record_stream, start_streams

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(300)]

STEP_TIMEOUT_S = 3.0
DRAIN_S = 1.0
#: G7's long streams: far more tokens than the tiny model makes in DRAIN_S beside the others
#: (the reliability model has 8,192 positions; on the fused bf16 step 1,000 tokens could
#: finish inside the budget), so the drain's deadline must cut them.
LONG_TOKENS = 8000
SHORT_TOKENS = 24
#: How late after the deadline a cut stream's terminal event may reach the client.
CUT_SLACK_S = 2.0


async def test_g6_stuck_worker(tiny_model: str, logs: str, size: str) -> None:
    n = int(sized("G4", size)["streams"])
    server = Served(tiny_model, ("--step-timeout", str(STEP_TIMEOUT_S)), log_dir=logs)
    with server:
        worker = server.worker_pids[0]
        async with client_for(server.url, n) as client, anyio.create_task_group() as tg:
            records = await start_streams(tg, client, n, max_tokens=480)
            stopped = time.monotonic()
            os.kill(worker, signal.SIGSTOP)
            health_503 = None
            async with httpx.AsyncClient(base_url=server.url, timeout=1) as probe:
                while time.monotonic() - stopped < STEP_TIMEOUT_S + 5:
                    try:
                        if (await probe.get("/health")).status_code == 503:
                            health_503 = time.monotonic() - stopped
                            break
                    except httpx.HTTPError:
                        break
                    await anyio.sleep(0.05)
        code = server.wait_exit(30)
        exited = time.monotonic() - stopped
        gone = poll(lambda: not server.survivors(), 5)
        survivors, shm = server.survivors(), server.leftover_shm()
        log = server.log()
    ends = [r.ended_at - stopped for r in records if r.ended_at is not None]
    messages = {r.error for r in records}
    told = sum(bool(r.error and "stuck" in r.error and r.done) for r in records)
    line = (
        f"G6 stuck worker (SIGSTOP, step deadline {STEP_TIMEOUT_S:.0f} s) [{size}]: load {n} "
        f"streams | faults 1 hang: /health 503 after "
        f"{health_503 if health_503 is None else f'{health_503:.2f} s'}, {told}/{n} streams "
        f"ended with the stuck-worker error ({sum(bool(m) for m in messages)} distinct "
        f"message(s)) by {max(ends, default=float('nan')):.2f} s, tree exited (code {code}) "
        f"after {exited:.1f} s | bad 0 | lost {n - told} streams without it (survivors "
        f"{len(survivors)}, shm leftovers {len(shm)})"
    )
    with checked_figure(line):
        assert health_503 is not None and health_503 < STEP_TIMEOUT_S + 1.5, log
        assert told == n, messages
        assert max(ends) < STEP_TIMEOUT_S + 1.5
        assert code not in (None, 0) and gone and not survivors and shm == set(), log


async def test_g7_drain_on_sigterm(tiny_model: str, logs: str, size: str) -> None:
    n = int(sized("G7", size)["streams"])
    server = Served(tiny_model, ("--drain-timeout", str(DRAIN_S)), log_dir=logs)
    with server:
        short = [StreamRecord() for _ in range(n // 2)]
        async with client_for(server.url, n) as client, anyio.create_task_group() as tg:
            long = await start_streams(tg, client, n - n // 2, max_tokens=LONG_TOKENS)
            for i, rec in enumerate(short):
                tg.start_soon(record_stream, client, rec, SHORT_TOKENS, f"short {i}")
            with anyio.fail_after(60):
                for rec in short:
                    await rec.first_event.wait()
            term = time.monotonic()
            server.send_signal(signal.SIGTERM)
            ready = (await client.get("/ready", timeout=2)).status_code
            health_s = time.monotonic() - term
            # Liveness stays 200 while the tree drains: only readiness turns.
            health = (await client.get("/health", timeout=2)).status_code
            r = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
            new_status, retry_after = r.status_code, r.headers.get("retry-after")
        code = server.wait_exit(DRAIN_S + 30)
        exited = time.monotonic() - term
        gone = poll(lambda: not server.survivors(), 5)
        survivors, shm = server.survivors(), server.leftover_shm()
        log = server.full_log()
    clean_short = sum(r.clean for r in short)
    # Cut at the deadline: the drain's terminal error event, then [DONE].
    cut = [r for r in long if r.error is not None and "shutting down" in r.error and r.done]
    finished_long = sum(r.clean for r in long)
    cut_s = sorted(r.ended_at - term for r in cut if r.ended_at is not None)
    spent = [int(m) for m in re.findall(r"drain budget spent: failed (\d+) request", log)]
    lost = len(short) - clean_short + len(long) - len(cut) - finished_long
    line = (
        f"G7 drain on SIGTERM (budget {DRAIN_S:.0f} s) [{size}]: load {n} streams | faults 1 "
        f"SIGTERM: /ready {ready} after {health_s * 1e3:.0f} ms (/health {health}), new "
        f"request {new_status} "
        f"Retry-After {retry_after}, {clean_short}/{len(short)} short streams finished, "
        f"{len(cut)}/{len(long)} long streams ({LONG_TOKENS} tokens) cut by the deadline with a "
        f"terminal error event after {_span(cut_s)} ({finished_long} finished first; the "
        f"front logged {sum(spent)} cut), exit code {code} after {exited:.1f} s | bad 0 | lost "
        f"{lost} (survivors {len(survivors)}, shm leftovers {len(shm)})"
    )
    with checked_figure(line):
        assert ready == 503 and health == 200
        assert new_status == 503 and retry_after is not None
        assert clean_short == len(short), [(r.error, r.transport_error) for r in short]
        assert len(cut) + finished_long == len(long), [(r.error, r.transport_error) for r in long]
        # The cut-off fired: streams too long to finish inside the budget were ended by it, at
        # the deadline (not before; within a loaded box's scheduling delay after), and the
        # front's own count of the streams it failed agrees.
        assert cut, "no long stream was cut at the drain deadline"
        assert DRAIN_S - 0.05 <= cut_s[0] and cut_s[-1] <= DRAIN_S + CUT_SLACK_S, cut_s
        assert spent == [len(cut)], spent
        assert code == 0 and exited < DRAIN_S + 5, log[-6000:]
        assert gone and not survivors and shm == set()


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{values[0]:.2f} s" if len(values) == 1 else f"{values[0]:.2f}-{values[-1]:.2f} s"


async def test_g7_drain_budget_zero(tiny_model: str, logs: str, size: str) -> None:
    server = Served(tiny_model, ("--drain-timeout", "0"), log_dir=logs)
    with server:
        async with client_for(server.url, 4) as client, anyio.create_task_group() as tg:
            records = await start_streams(tg, client, 4, max_tokens=LONG_TOKENS)
            term = time.monotonic()
            server.send_signal(signal.SIGTERM)
        code = server.wait_exit(30)
        exited = time.monotonic() - term
        gone = poll(lambda: not server.survivors(), 5)
        survivors, shm = server.survivors(), server.leftover_shm()
    ended = sum(r.done and r.error is not None for r in records)
    line = (
        f"G7 drain budget 0 [{size}]: load 4 streams | faults 1 SIGTERM: exit code {code} after "
        f"{exited:.1f} s, {ended}/4 streams got a terminal error event | bad 0 | lost "
        f"{4 - ended} (survivors {len(survivors)}, shm leftovers {len(shm)})"
    )
    with checked_figure(line):
        assert code == 0 and exited < 4.0
        assert ended == 4
        assert gone and not survivors and shm == set()
