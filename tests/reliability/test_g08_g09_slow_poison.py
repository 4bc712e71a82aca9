"""G8 slow readers and G9 poison requests, on the shared server.

G8: clients that stop reading mid-stream (a raw socket with a 4 KiB receive buffer, holding
the connection open) next to healthy streams. The shared server runs `--stall-timeout 2`: each
stalled stream is aborted (cause "stall") soon after, its blocks freed, and the healthy streams
finish. The front's RSS growth is set beside the unread output (the stalled streams' generated
tokens, from /metrics, at the bytes a token costs in the answer, less what their clients read)
and bounded at half of it (`UNREAD_FACTOR`): the mailbox merges undelivered deltas, packed, so
it holds the unread tokens, in fewer bytes than their JSON, until the stall abort.

G9: requests that raise inside per-request code: the EngineCore's output update (seed
ENGINE_POISON_SEED) and the Worker's sampler (WORKER_POISON_SEED), through `VX_TEST_POISON`.
Each fails alone (non-streaming: 500 in the envelope; streaming: an error event then [DONE]),
the healthy streams running beside them finish cleanly, and no process restarts (same pids).
"""

from __future__ import annotations

import json
import socket
import time

import anyio
import anyio.abc
import httpx
import pytest

from tests.reliability.conftest import (
    ENGINE_POISON_SEED,
    WORKER_POISON_SEED,
    checked_figure,
    sized,
)
from tests.reliability.harness import MODEL_NAME, Served, accounting, delta, total
from tests.reliability.streams import StreamRecord, client_for, record_stream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(300)]


HEALTHY_TOKENS = 200
#: G8: the most the front's RSS may grow by, as a share of the unread output's bytes: half.
#: The mailbox packs a lagging reader's tokens and logprob rows into arrays of 2- and 4-byte
#: numbers (`vx.http.engine_client._Segment`), about a third of their bytes in the answer, and
#: a stream keeps no prompt logprobs past its first chunk; the whole front measured 0.34-0.38x
#: in the CI tier, 0.24-0.32x in stress (0.7-0.9x before those two, 2.0-2.7x in Python lists).
UNREAD_FACTOR = 0.5


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


#: The stalled streams' request (besides `stream`): ~10 MB of events each (see `_slow_reader`).
SLOW_BODY = {"model": MODEL_NAME, "prompt": "hello world " * 10, "max_tokens": 940,
             "ignore_eos": True, "logprobs": 20, "echo": True, "n": 16}  # fmt: skip


def _bytes_per_token(url: str) -> float:
    """The bytes one generated token of a stalled stream's request costs in its answer: the
    same request (one choice, not streamed: no merging of events to vary it) answered at 8 and
    at 40 tokens, the difference per token. Streamed, the events took 340-443 B a token against
    this 394 B (merged events share an envelope)."""
    sizes = {}
    for k in (8, 40):
        body = {**SLOW_BODY, "n": 1, "max_tokens": k}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        sizes[k] = len(r.content)
    return (sizes[40] - sizes[8]) / 32


async def _slow_reader(url_port: int, opened: list[float], read: list[int]) -> None:
    """Asks for a large stream, reads the first event, then stops reading (socket kept);
    appends the bytes it read to `read`."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setblocking(False)
    try:
        raw.connect(("127.0.0.1", url_port))
    except BlockingIOError:
        await anyio.wait_socket_writable(raw)
    # 16 choices with 20 logprobs per token: ~10 MB of events over the request, well over what
    # loopback's socket buffers absorb (tcp_wmem up to 4 MiB), so the writes must block. (With
    # ~3 MB, some stalled streams finished into the kernel's buffers.)
    body = json.dumps({**SLOW_BODY, "stream": True}).encode()
    raw.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    buf = b""
    while b"data: " not in buf:
        await anyio.wait_socket_readable(raw)
        buf += raw.recv(4096)
        assert not buf.startswith(b"HTTP/1.1 4"), buf[:300]
    opened.append(time.monotonic())
    read.append(len(buf))
    try:
        # Hold the connection without reading until the server gives up on us (it closes).
        await anyio.sleep(30)
    finally:
        raw.close()


async def test_g8_slow_readers(shared: Served, size: str) -> None:
    n_slow, n_ok = int(sized("G8", size)["slow"]), int(sized("G8", size)["healthy"])
    per_token = await anyio.to_thread.run_sync(_bytes_per_token, shared.url)
    before = shared.scrape()
    rss0 = _rss_mib(shared.proc.pid)
    opened: list[float] = []
    read: list[int] = []
    healthy = [StreamRecord() for _ in range(n_ok)]
    stalls = 0.0
    started = time.monotonic()
    async with client_for(shared.url, n_ok) as client, anyio.create_task_group() as tg:
        for _ in range(n_slow):
            tg.start_soon(_slow_reader, shared.port, opened, read)
        for i, rec in enumerate(healthy):
            tg.start_soon(record_stream, client, rec, HEALTHY_TOKENS, f"healthy {i}")
        rss_peak = rss0
        # Until every slow stream was aborted for stalling (the metric), or 30 s.
        while time.monotonic() - started < 30:
            rss_peak = max(rss_peak, _rss_mib(shared.proc.pid))
            m = shared.scrape()
            stalls = total(m, 'vx:request_aborted_total{cause="stall"}') - total(
                before, 'vx:request_aborted_total{cause="stall"}'
            )
            if stalls >= n_slow and all(r.ended_at for r in healthy):
                break
            await anyio.sleep(0.2)
        detected = time.monotonic() - max(opened, default=started)
        tg.cancel_scope.cancel()
    after = shared.scrape()
    d = delta(accounting(after), accounting(before))
    clean = sum(r.clean for r in healthy)
    # The unread output: what the engine generated for the stalled streams (every token that
    # reached the front, less the healthy streams'), at the fewest bytes a token costs, less
    # what their clients read.
    generated = "vx:generation_tokens_total"
    stalled_tokens = total(after, generated) - total(before, generated) - HEALTHY_TOKENS * clean
    unread_mib = (stalled_tokens * per_token - sum(read)) / 2**20
    growth = rss_peak - rss0
    line = (
        f"G8 slow readers [{size}]: load {n_slow} stalled + {n_ok} healthy streams | faults "
        f"{stalls:.0f} stalls aborted (stall timeout 2 s) by {detected:.1f} s after the last "
        f"stopped reading | bad 0 | lost {n_ok - clean} ({clean}/{n_ok} healthy clean; front "
        f"RSS peak +{growth:.1f} MiB against {unread_mib:.1f} MiB unread, x"
        f"{growth / unread_mib if unread_mib > 0 else float('inf'):.2f} ({stalled_tokens:.0f} "
        f"stalled tokens x {per_token:.0f} B, less {sum(read) / 1024:.0f} KiB read); received "
        f"{d['received']:.0f} = finished {d['finished']:.0f} + aborted {d['aborted']:.0f})"
    )
    with checked_figure(line):
        assert stalls == n_slow
        assert clean == n_ok, [(r.error, r.transport_error) for r in healthy]
        # The front's growth is bounded by the unread output, not by a flat allowance far above it.
        assert unread_mib > 0 and growth <= UNREAD_FACTOR * unread_mib, (growth, unread_mib)
        assert d["received"] == n_slow + n_ok == d["finished"] + d["aborted"]


async def test_g9_poison_requests(shared: Served, size: str) -> None:
    n_poison, n_ok = int(sized("G9", size)["poison"]), int(sized("G9", size)["healthy"])
    before = accounting(shared.scrape())
    pids = list(shared.pids)
    healthy = [StreamRecord() for _ in range(n_ok)]
    outcomes: dict[str, int] = {"stream_error_event": 0, "plain_500": 0, "wrong": 0}
    wrong: list[str] = []

    async def poison(client: httpx.AsyncClient, i: int) -> None:
        seed = ENGINE_POISON_SEED if i % 2 == 0 else WORKER_POISON_SEED
        stream = i % 4 >= 2
        body = {"model": MODEL_NAME, "prompt": f"poison {i}", "max_tokens": 32, "seed": seed,
                "temperature": 1.0, "stream": stream}  # fmt: skip
        if stream:
            rec = StreamRecord()
            await record_stream_with(client, rec, body)
            if rec.status == 200 and rec.error and rec.done:
                outcomes["stream_error_event"] += 1
                return
            wrong.append(f"stream seed {seed}: {rec}")
        else:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 500 and r.json()["error"]["message"]:
                outcomes["plain_500"] += 1
                return
            wrong.append(f"plain seed {seed}: {r.status_code} {r.text[:200]}")
        outcomes["wrong"] += 1

    async with client_for(shared.url, n_ok + n_poison) as client:
        async with anyio.create_task_group() as tg:
            for i, rec in enumerate(healthy):
                tg.start_soon(record_stream, client, rec, 64, f"healthy {i}")
            for i in range(n_poison):
                tg.start_soon(poison, client, i)
    d = delta(accounting(shared.scrape()), before)
    clean = sum(r.clean for r in healthy)
    died = [p for p in pids if p not in shared.survivors()]
    engine_pids = httpx.get(shared.url + "/version", timeout=5).json()["engine_pids"]
    restarts = len(died) + (engine_pids != [shared.engine_pid])
    line = (
        f"G9 poison requests [{size}]: load {n_ok} healthy streams | faults {n_poison} poison "
        f"requests (EngineCore update and Worker sampler): {outcomes['plain_500']} x 500, "
        f"{outcomes['stream_error_event']} x stream error event, {outcomes['wrong']} wrong; "
        f"{restarts} restarts ({len(died)} of {len(pids)} pids gone, engine pids {engine_pids}) "
        f"| bad 0 | lost {n_ok - clean} ({clean}/{n_ok} healthy clean; aborted "
        f"{d['aborted']:.0f} + finished {d['finished']:.0f} = received {d['received']:.0f})"
    )
    with checked_figure(line):
        assert not wrong, wrong
        assert clean == n_ok, [(r.error, r.transport_error) for r in healthy]
        assert restarts == 0, (died, engine_pids)
        assert d["received"] == n_ok + n_poison and d["aborted"] == n_poison


async def record_stream_with(client: httpx.AsyncClient, rec: StreamRecord, body: dict) -> None:
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            rec.status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    rec.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec.error = event["error"]["message"]
    except httpx.HTTPError as e:
        rec.transport_error = repr(e)
