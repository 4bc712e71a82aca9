"""G3 bad-input barrage: Schemathesis (negative mode, from the server's own /openapi.json) plus a
fixed corpus of malformed requests, while valid streams run and /health is polled.

Pass: every bad request gets a 4xx in the OpenAI envelope (non-empty message, a type; the field
named in `param` where the corpus knows it), errors for `stream=true` come as an HTTP status
before any SSE byte, a body over the limit is refused before it is read in full, 0 x 5xx, the
valid streams have 0 errors, /health answers 200 throughout, and the EngineCore's pid is
unchanged (no process of the tree died). The one exception to the envelope is a request line or
header block over hypercorn's limit, which h11 refuses (431) before vx sees it.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import anyio
import httpx
import pytest

from tests.reliability.conftest import checked_figure, sized
from tests.reliability.harness import MODEL_NAME, Served, poll

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(900)]

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
LONG = "hello world " * 800  # over the shared server's 1024-token context

#: (path, body: dict for JSON or bytes as sent, expected status, expected param or None)
CORPUS: list[tuple[str, object, int, str | None]] = [
    (C, b'{"model": "tiny", "prompt": ', 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2, 3]", 400, None),
    (C, b'"a string"', 400, None),
    (C, b"42", 400, None),
    (C, b"null", 400, None),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (C, b'{"prompt": "x", "temperature": Infinity}', 400, None),
    (C, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (C, b'{"prompt": "\xff\xfe bad utf-8"}', 400, None),
    (C, b"[" * 10_000 + b"]" * 10_000, 400, None),
    (C, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, None),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": [10**9]}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 2**63}, 400, "prompt"),  # context_length_exceeded
    (C, {"prompt": "x", "max_tokens": 2**64}, 400, "prompt"),
    (C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": 3}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": -1}, 400, "n"),
    (C, {"prompt": "x", "n": 100_000}, 400, "n"),
    (C, {"prompt": "x", "n": 1.5}, 400, "n"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "x", "stop": ["s"] * 20}, 400, "stop"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "stop": 5}, 400, "stop"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": LONG}, 400, "prompt"),
    (C, {"prompt": LONG, "stream": True}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": 100_000}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": 100_000, "stream": True}, 400, "prompt"),
    (C, {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    (C, {"model": "no-such-model", "prompt": "x", "stream": True}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": None}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [123]}, 400, "messages[0]"),
    (CHAT, {"messages": [{}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, {"messages": OK_MSG, "top_logprobs": 5}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"messages": OK_MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}], "stream": True}, 400, "messages"),
    (CHAT, {"messages": OK_MSG, "response_format": {"type": "nonsense"}}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**63]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/v1/no-such-route", {}, 404, None),
]


def check_envelope(r: httpx.Response | object, status: int, body: bytes) -> str | None:
    """None when `body` is a 4xx OpenAI error envelope, else what is wrong."""
    if not 400 <= status < 500:
        return f"status {status}"
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "no OpenAI error envelope"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "empty message"
    if not isinstance(err.get("type"), str):
        return "no type"
    return None


def run_schemathesis(url: str, per_operation: int, result: dict[str, object]) -> None:
    """Negative-mode cases for every POST operation of /openapi.json (in a thread)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    session = requests.Session()  # keep-alive: one connection, not one per case
    statuses: collections.Counter[int] = collections.Counter()
    failures: list[str] = []
    bodies: set[str] = set()

    def make_fuzz(op):  # type: ignore[no-untyped-def]
        strategy = op.as_strategy(generation_mode=GenerationMode.NEGATIVE)

        @settings(max_examples=per_operation, database=None, deadline=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=strategy)
        def fuzz(case) -> None:  # type: ignore[no-untyped-def]
            r = case.call(base_url=url, session=session, timeout=60)
            statuses[r.status_code] += 1
            bodies.add(f"{op.path} {case.body!r}")
            problem = check_envelope(r, r.status_code, r.content)
            if problem and len(failures) < 20:
                failures.append(f"{op.path} {case.body!r:.200}: {problem}: {r.text[:200]}")

        return fuzz

    for op_result in schema.get_all_operations():
        op = op_result.ok()
        if op.method.upper() == "POST":
            make_fuzz(op)()
    result.update(statuses=statuses, failures=failures, unique=len(bodies))


async def send_corpus(server: Served) -> tuple[int, list[str]]:
    failures: list[str] = []
    sent = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for path, body, status, param in CORPUS:
            if isinstance(body, bytes):
                content = body
            else:
                content = json.dumps({"model": MODEL_NAME, **body}).encode()  # type: ignore[dict-item]
            headers = {"content-type": "application/json"}
            async with client.stream("POST", path, content=content, headers=headers) as r:
                raw = await r.aread()
                ctype = r.headers.get("content-type", "")
            sent += 1
            problem = check_envelope(r, r.status_code, raw)
            if problem is None and r.status_code != status:
                problem = f"status {r.status_code}, expected {status}"
            if problem is None and param is not None and json.loads(raw)["error"]["param"] != param:
                problem = f"param {json.loads(raw)['error']['param']!r}, expected {param!r}"
            if problem is None and "event-stream" in ctype:
                problem = "an error inside an SSE stream"
            if problem:
                failures.append(f"{path} {content[:120]!r}: {problem}: {raw[:200]!r}")
        # A wrong method and a huge header block.
        r = await client.get(C)
        sent += 1
        if problem := check_envelope(r, r.status_code, r.content):
            failures.append(f"GET {C}: {problem}")
        r = await client.post(C, json={"prompt": "x"}, headers={"x-big": "a" * 200 * 1024})
        sent += 1
        if r.status_code != 431 and check_envelope(r, r.status_code, r.content):
            failures.append(f"200 KiB header: status {r.status_code}")
    sent += await _oversized_bodies(server, failures)
    return sent, failures


async def _oversized_bodies(server: Served, failures: list[str]) -> int:
    """Over the body limit: a declared Content-Length sent with `Expect: 100-continue` (what
    curl does for large bodies) must get 413 without a byte of body sent; a chunked body that
    keeps coming must be cut off (413, or a reset: hypercorn closes without lingering, see
    docs/reliability.md) long before it is sent in full."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        rss0 = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    sock = await anyio.connect_tcp("127.0.0.1", server.port)
    await sock.send(
        f"POST {C} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "content-length: 100000000\r\nexpect: 100-continue\r\n\r\n".encode()
    )
    got = b""
    with anyio.move_on_after(30):
        # hypercorn answers 100 Continue at once (not on the app's first read): skip it.
        while b"\r\n\r\n" not in got.removeprefix(b"HTTP/1.1 100 ").partition(b"\r\n\r\n")[2]:
            got += await sock.receive()
            if got.startswith(b"HTTP/1.1 413"):
                break
    await sock.aclose()
    got = got.partition(b"\r\n\r\n")[2] if got.startswith(b"HTTP/1.1 100 ") else got
    if not got.startswith(b"HTTP/1.1 413"):
        failures.append(f"declared oversized body: {got[:100]!r}")
    for _ in range(CHUNKED_REPEATS):
        await _chunked_oversized_body(server, failures)

    def grown_mib() -> float:
        with open(f"/proc/{server.proc.pid}/status") as f:
            rss1 = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        return (rss1 - rss0) / 1024

    # A chunked body is counted as it arrives, so up to the limit (32 MiB) passes through the
    # front each time; once the connection is gone that memory must be back (poll: it is freed
    # asynchronously). A body kept would leave >= 32 MiB per repeat, >= 96 MiB for the three;
    # what this bound (two bodies' worth) tolerates is the allocator's and the concurrent
    # valid streams' noise (seen up to 18 MiB on CI, and once 33 MiB in a full CI run whose
    # repeats of this test alone stayed under the old one-body bound).
    if not poll(lambda: grown_mib() < (CHUNKED_REPEATS - 1) * BODY_LIMIT_MIB, 5):
        failures.append(
            f"front RSS grew {grown_mib():.0f} MiB on {CHUNKED_REPEATS} oversized bodies"
        )
    return 1 + CHUNKED_REPEATS


#: The server's default body limit, and how often the chunked oversized body is sent.
BODY_LIMIT_MIB = 32
CHUNKED_REPEATS = 3


async def _chunked_oversized_body(server: Served, failures: list[str]) -> None:
    """A chunked body that keeps coming must be cut off long before it is sent in full."""
    sock = await anyio.connect_tcp("127.0.0.1", server.port)
    await sock.send(
        f"POST {C} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n".encode()
    )
    got, sent = b"", 0
    chunk = b"a" * (1 << 20)
    with anyio.move_on_after(30):
        async with anyio.create_task_group() as tg:

            async def pump() -> None:
                nonlocal sent
                while sent < 100 << 20:
                    try:
                        await sock.send(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                    except (anyio.BrokenResourceError, OSError):
                        return
                    sent += len(chunk)

            async def read() -> None:
                nonlocal got
                while b"\r\n\r\n" not in got:
                    try:
                        got += await sock.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        break
                tg.cancel_scope.cancel()

            tg.start_soon(pump)
            tg.start_soon(read)
    await sock.aclose()
    if got and not got.startswith(b"HTTP/1.1 413"):
        failures.append(f"chunked oversized body: {got[:100]!r}")
    if sent >= 100 << 20:
        failures.append("chunked oversized body was read in full")


async def test_g3_bad_input_barrage(shared: Served, size: str) -> None:
    fuzz_total, n_valid = int(sized("G3", size)["fuzz"]), int(sized("G3", size)["valid_streams"])
    engine_pid = shared.engine_pid
    fuzz: dict[str, object] = {}
    health: collections.Counter[int] = collections.Counter()
    valid = {"ok": 0, "bad": 0}
    done = threading.Event()

    async def valid_streams(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL_NAME, "prompt": "valid", "max_tokens": 16, "stream": True,
                "ignore_eos": True}  # fmt: skip
        while not done.is_set():
            async with client.stream("POST", C, json=body) as r:
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
            good = r.status_code == 200 and lines[-1:] == ["data: [DONE]"]
            valid["ok" if good and not any('"error"' in ln for ln in lines) else "bad"] += 1
            await anyio.sleep(0.2)  # interleaved, not a load test: leave the fuzzer CPU

    async def poll_health(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            health[(await client.get("/health")).status_code] += 1
            await anyio.sleep(0.25)

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=shared.url, timeout=60) as client:
        async with anyio.create_task_group() as tg:
            for _ in range(n_valid):
                tg.start_soon(valid_streams, client)
            tg.start_soon(poll_health, client)
            corpus_sent, corpus_failures = await send_corpus(shared)
            await anyio.to_thread.run_sync(run_schemathesis, shared.url, fuzz_total // 4, fuzz)
            done.set()
    elapsed = time.monotonic() - started
    statuses: collections.Counter[int] = fuzz["statuses"]  # type: ignore[assignment]
    fuzz_sent = sum(statuses.values())
    fivexx = sum(v for k, v in statuses.items() if k >= 500)
    version = httpx.get(shared.url + "/version", timeout=5).json()
    line = (
        f"G3 bad inputs [{size}]: load {valid['ok'] + valid['bad']} valid streams alongside, "
        f"{elapsed:.0f} s | faults 0 | bad {fuzz_sent + corpus_sent} tried ({fuzz_sent} "
        f"schemathesis negative, {fuzz['unique']} distinct; {corpus_sent} corpus): statuses "
        f"{dict(sorted(statuses.items()))}, 5xx {fivexx}, envelope failures "
        f"{len(fuzz['failures']) + len(corpus_failures)} | lost {valid['bad']} valid streams "  # type: ignore[arg-type]
        f"(/health {dict(health)}; engine pid unchanged {version['engine_pids'] == [engine_pid]})"
    )
    with checked_figure(line):
        assert not corpus_failures, "\n".join(corpus_failures)
        assert not fuzz["failures"], "\n".join(fuzz["failures"])  # type: ignore[arg-type]
        assert fuzz_sent + corpus_sent >= (1000 if size == "ci" else fuzz_total)
        assert valid["bad"] == 0 and valid["ok"] > 0
        assert set(health) == {200}
        assert version["engine_pids"] == [engine_pid]
