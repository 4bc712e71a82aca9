"""G1 steady streams: N concurrent SSE streams held for D seconds against a real `vx serve`.

Pass: 0 non-2xx, 0 truncated streams (exactly one `[DONE]`, last), one id per stream, the
finish reason and usage of every stream exact, the server's accounting equal to the client's,
and afterwards (the `shared` fixture) KV self-check ok, nothing running, fds and shm back.
"""

from __future__ import annotations

import json
import time

import anyio
import httpx
import pytest

from tests.reliability.conftest import checked_figure, sized
from tests.reliability.harness import MODEL_NAME, Served, accounting, delta

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(600)]

MAX_TOKENS = 24


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def one_stream(client: httpx.AsyncClient, i: int, tally: dict[str, int]) -> None:
    body = {"model": MODEL_NAME, "prompt": f"stream {i} says hello", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally["non_2xx"] += 1
            await r.aread()
            return
        events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        tally["truncated"] += 1
        return
    chunks = [json.loads(e) for e in events[:-1]]
    if len({c["id"] for c in chunks}) != 1 or any("error" in c for c in chunks):
        tally["bad_shape"] += 1
        return
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    usage = chunks[-1]["usage"]
    if reasons != ["length"] or usage["completion_tokens"] != MAX_TOKENS:
        tally["bad_shape"] += 1
        return
    tally["ok"] += 1


async def test_g1_steady_streams(shared: Served, size: str) -> None:
    n, seconds = int(sized("G1", size)["streams"]), sized("G1", size)["seconds"]
    tally = {"ok": 0, "non_2xx": 0, "truncated": 0, "bad_shape": 0, "transport": 0}
    before = accounting(shared.scrape())
    rss_before = _rss_kib(shared.proc.pid)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=shared.url, timeout=60, limits=limits) as client:

        async def loop(i: int) -> None:
            while time.monotonic() - started < seconds:
                try:
                    await one_stream(client, i, tally)
                except httpx.HTTPError:
                    tally["transport"] += 1

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(loop, i)
    elapsed = time.monotonic() - started
    sent = sum(tally.values())
    after = accounting(shared.scrape())
    d = delta(after, before)
    rss_growth_mib = (_rss_kib(shared.proc.pid) - rss_before) / 1024
    line = (
        f"G1 steady streams [{size}]: load {n} streams x {elapsed:.0f} s = {sent} requests "
        f"({sent * MAX_TOKENS / elapsed:.0f} tok/s) | faults 0 | bad 0 | lost "
        f"{sent - tally['ok']} (non-2xx {tally['non_2xx']}, truncated {tally['truncated']}, "
        f"shape {tally['bad_shape']}, transport {tally['transport']}; server finished "
        f"{d['finished']:.0f} of received {d['received']:.0f}; front RSS +{rss_growth_mib:.1f} MiB)"
    )
    with checked_figure(line):
        assert tally["ok"] == sent > 0, tally
        assert d == {"received": sent, "rejected": 0, "finished": sent, "aborted": 0}, d
        assert rss_growth_mib < 50
