"""G4 and G5: kill -9 of a worker, of the EngineCore, and of the front, under live streams.

G4 (worker, then in a separate run the EngineCore): /health answers 503 within 2 s, a new
request gets 503 with Retry-After, every stream ends with an error event within 2 s, and the
whole tree exits (non-zero) within 10 s leaving no process and no shared memory behind.
G5 (the front): the EngineCore, the workers and the resource tracker exit by themselves within
30 s (the rings notice the dead peer), and the tracker unlinks every segment.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import httpx
import pytest

from tests.reliability.conftest import checked_figure, sized
from tests.reliability.harness import MODEL_NAME, Served, poll
from tests.reliability.streams import client_for, start_streams

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(300)]


async def _first_503(url: str, since: float, limit_s: float) -> float | None:
    """Seconds from `since` to the first /health 503 (polled every 20 ms), None if never."""
    async with httpx.AsyncClient(base_url=url, timeout=1) as client:
        while time.monotonic() - since < limit_s:
            try:
                if (await client.get("/health")).status_code == 503:
                    return time.monotonic() - since
            except httpx.HTTPError:
                return None  # gone before it said 503
            await anyio.sleep(0.02)
    return None


@pytest.mark.parametrize("victim", ["worker", "engine"])
async def test_g4_child_kill9(tiny_model: str, logs: str, size: str, victim: str) -> None:
    n = int(sized("G4", size)["streams"])
    server = Served(tiny_model, log_dir=logs)
    with server:
        pid = server.worker_pids[0] if victim == "worker" else server.engine_pid
        retry_after: str | None = None
        async with client_for(server.url, n) as client, anyio.create_task_group() as tg:
            records = await start_streams(tg, client, n, max_tokens=480)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            health_503 = await _first_503(server.url, killed, 5)
            if health_503 is not None:
                try:
                    r = await client.post(
                        "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}, timeout=2
                    )
                    retry_after = r.headers.get("retry-after") if r.status_code == 503 else None
                except httpx.HTTPError:
                    pass
        code = server.wait_exit(15)
        exited = time.monotonic() - killed
        gone = poll(lambda: not server.survivors(), 5)
        survivors, shm = server.survivors(), server.leftover_shm()
        log = server.log()
    ends = [r.ended_at - killed for r in records if r.ended_at is not None]
    with_error = sum(r.error is not None and r.done for r in records)
    line = (
        f"G4 kill -9 {victim} [{size}]: load {n} streams | faults 1 kill -9: /health "
        f"503 after {health_503 if health_503 is None else f'{health_503:.2f} s'}, new request "
        f"503 Retry-After {retry_after}, {with_error}/{n} streams ended with an error event, "
        f"last after {max(ends, default=float('nan')):.2f} s, tree exited (code {code}) after "
        f"{exited:.1f} s | bad 0 | lost {n - with_error} streams without an error event "
        f"(survivors {len(survivors)}, shm leftovers {len(shm)})"
    )
    with checked_figure(line):
        assert health_503 is not None and health_503 < 2.0, log
        assert retry_after is not None
        assert with_error == n and max(ends) < 2.0, [(r.error, r.transport_error) for r in records]
        assert code is not None and code != 0 and exited < 10.0, log
        assert gone and not survivors and shm == set(), (survivors, shm)


async def test_g5_front_kill9(tiny_model: str, logs: str, size: str) -> None:
    server = Served(tiny_model, log_dir=logs)
    with server:
        children = [p for p in server.pids if p != server.proc.pid]
        async with client_for(server.url, 4) as client, anyio.create_task_group() as tg:
            records = await start_streams(tg, client, 4, max_tokens=480)
            killed = time.monotonic()
            server.proc.kill()
        server.proc.wait()
        gone = poll(lambda: not any(map(_alive, children)), 30, 0.05)
        exited = time.monotonic() - killed
        shm_clean = poll(lambda: server.leftover_shm() == set(), 10)
        alive_children = [p for p in children if _alive(p)]
        shm = server.leftover_shm()
        log = server.log()
    cut = sum(r.transport_error is not None or not r.done for r in records)
    line = (
        f"G5 kill -9 front [{size}]: load 4 streams | faults 1 kill -9: "
        f"{len(children) - len(alive_children)}/{len(children)} children (EngineCore, worker, "
        f"resource tracker) exited by themselves after {exited:.1f} s; {cut}/4 client streams "
        f"cut | bad 0 | lost {len(alive_children) + len(shm)} (children left "
        f"{len(alive_children)}, shm leftovers {len(shm)})"
    )
    with checked_figure(line):
        assert gone and exited < 30.0, log
        assert shm_clean and not shm, shm


def _alive(pid: int) -> bool:
    from tests.reliability.harness import alive

    return alive(pid)
