"""Client disconnects abort the request in the front and in the engine.

Driven three ways: the ASGI app directly (a `receive` that yields http.disconnect), real
HTTP/1.1 through hypercorn + httpx, and real HTTP/2 (h2c) through hypercorn, both with httpx
closing the connection and with a raw h2 client resetting one stream (RST_STREAM) while its
connection stays open. A client that stops reading is aborted as "stall".
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from tests.http.conftest import Harness, running_app
from vx.http.serve import serve_http
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

LONG = {"prompt": "Hello", "max_tokens": 250, "ignore_eos": True}


@contextlib.asynccontextmanager
async def served(app: Any, **kwargs: Any) -> AsyncIterator[str]:
    """The app behind hypercorn on a free loopback port; yields the base URL."""
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        serve = functools.partial(
            serve_http, app, host="127.0.0.1", port=0, shutdown_trigger=shutdown.wait,
            graceful_timeout_s=0.5, **kwargs,
        )  # fmt: skip
        port = await tg.start(serve)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            shutdown.set()


async def assert_aborted(h: Harness, cause: str = "client_disconnect") -> None:
    await h.engine.wait_for_async(lambda e: bool(e.aborted_ids(cause)) and not e.running)
    with anyio.fail_after(5):
        while h.metrics.totals()["aborted"] < 1:
            await anyio.sleep(0.005)
    assert h.metrics.totals() == {"received": 1, "rejected": 0, "finished": 0, "aborted": 1}
    assert h.client.num_unfinished == 0
    text = h.metrics.render().decode()
    assert f'vx:request_aborted_total{{cause="{cause}",model_name="tiny"}} 1.0' in text


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "server": ("test", 80), "client": ("127.0.0.1", 5000),
    }  # fmt: skip


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_asgi_disconnect_aborts(tokenizer: Tokenizer, stream: bool, path: str) -> None:
    async with running_app(tokenizer, step_s=0.002) as h:
        body = dict(LONG, stream=stream)
        if path.endswith("chat/completions"):
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": stream,
            }
        first_chunk = anyio.Event()
        sent: list[dict[str, Any]] = []
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {
                    "type": "http.request",
                    "body": json.dumps(body).encode(),
                    "more_body": False,
                }
            if stream:
                await first_chunk.wait()  # leave after the first SSE event
            else:
                await h.engine.wait_for_async(lambda e: len(e.running) == 1)  # leave mid-generation
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk.set()

        with anyio.fail_after(10):
            await h.app(_scope(path), receive, send)
        await assert_aborted(h)
        if stream:
            assert sent[0]["status"] == 200
            assert not any(m.get("body", b"").startswith(b"data: [DONE]") for m in sent)


async def test_http1_stream_closed_midway(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, served(h.app) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            async with c.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as r:
                assert r.http_version == "HTTP/1.1" and r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
        await assert_aborted(h)


async def test_http1_non_streaming_cancelled(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, served(h.app) as url:
        async with httpx.AsyncClient(base_url=url) as c, anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(c.post, "/v1/completions", json=LONG))
            await h.engine.wait_for_async(lambda e: len(e.running) == 1)
            tg.cancel_scope.cancel()  # the client gives up: httpx closes the connection
        await assert_aborted(h)


async def test_http2_connection_closed_midway(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, served(h.app) as url:
        c = httpx.AsyncClient(base_url=url, http1=False, http2=True)  # h2c, prior knowledge
        async with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
            # NOTE: closing only the response does not reset an HTTP/2 stream in httpx; closing
            # the client closes the connection, which hypercorn reports for every stream.
            await c.aclose()
        await assert_aborted(h)


class RawH2:
    """A minimal h2c client (prior knowledge) that can reset one stream and stop reading."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.sock = stream
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.status: dict[int, int] = {}

    async def start(self) -> None:
        self.conn.initiate_connection()
        await self.flush()

    async def flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            await self.sock.send(out)

    async def request(self, path: str, body: dict[str, Any]) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        raw = json.dumps(body).encode()
        headers = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "test"),
                   ("content-type", "application/json"), ("content-length", str(len(raw)))]  # fmt: skip
        self.conn.send_headers(stream_id, headers)
        self.conn.send_data(stream_id, raw, end_stream=True)
        self.data[stream_id] = bytearray()
        await self.flush()
        return stream_id

    async def read_until(self, predicate: Any, *, ack: bool = True) -> None:
        with anyio.fail_after(10):
            while not predicate():
                for event in self.conn.receive_data(await self.sock.receive()):
                    if isinstance(event, h2.events.ResponseReceived):
                        self.status[event.stream_id] = int(dict(event.headers)[b":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        self.data[event.stream_id] += event.data
                        if ack:
                            self.conn.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
                    elif isinstance(event, h2.events.StreamEnded):
                        self.ended.add(event.stream_id)
                await self.flush()

    async def reset(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
        await self.flush()


async def test_http2_rst_stream_aborts_only_that_stream(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, served(h.app) as url:
        port = int(url.rsplit(":", 1)[1])
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            client = RawH2(sock)
            await client.start()
            sid = await client.request("/v1/completions", dict(LONG, stream=True))
            await client.read_until(lambda: b"data: " in client.data[sid])
            assert client.status[sid] == 200
            await client.reset(sid)
            await assert_aborted(h)
            # The connection stays usable: a second request on it completes normally.
            sid2 = await client.request(
                "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True}
            )
            await client.read_until(lambda: sid2 in client.ended)
            assert client.data[sid2].endswith(b"data: [DONE]\n\n")


async def test_client_that_stops_reading_is_aborted_as_stall(tokenizer: Tokenizer) -> None:
    app = running_app(tokenizer, step_s=0.0005, stall_timeout_s=0.3, max_model_len=100_000)
    async with app as h, served(h.app) as url:
        port = int(url.rsplit(":", 1)[1])
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            client = RawH2(sock)
            await client.start()
            body = dict(LONG, max_tokens=50_000, logprobs=5, stream=True)
            sid = await client.request("/v1/completions", body)
            # Read without granting flow-control credit: the server's writes block once the
            # 64 KiB stream window is used up, and the stall timeout ends the request.
            await client.read_until(lambda: b"data: " in client.data[sid], ack=False)
            await h.engine.wait_for_async(lambda e: bool(e.aborted_ids("stall")), timeout=20)
    assert h.metrics.totals()["aborted"] == 1


async def test_keepalive_comments_while_the_engine_is_silent(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, keepalive_s=0.02) as h:
        h.engine.gate.clear()  # admitted, but no token comes
        keepalive = anyio.Event()
        bodies: list[bytes] = []
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                raw = json.dumps({"prompt": "Hello", "max_tokens": 3, "stream": True}).encode()
                return {"type": "http.request", "body": raw, "more_body": False}
            await anyio.sleep_forever()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message.get("body", b""))
                if message.get("body") == b": keep-alive\n\n" and not keepalive.is_set():
                    keepalive.set()
                    h.engine.gate.set()

        with anyio.fail_after(10):
            await h.app(_scope("/v1/completions"), receive, send)
        assert keepalive.is_set()
        assert bodies[-2] == b"data: [DONE]\n\n" and bodies[-1] == b""
        assert h.metrics.totals()["finished"] == 1
