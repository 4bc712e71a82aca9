"""The load generator's lean HTTP/1.1 client (`vx.bench.client`) against a scripted raw server:
chunked, length-delimited and close-delimited bodies cut at every byte, keep-alive reuse, an
error status, and a server that leaves mid-stream."""

from __future__ import annotations

import asyncio

import pytest

from vx.bench.client import HTTPStatusError, LeanClient

pytestmark = pytest.mark.anyio

EVENTS = [b'{"t": "a\xe2\x80\xa8b"}', b'{"t": "2"}', b"[DONE]"]
SSE = b"".join(b"data: " + e + b"\r\n\r\n" for e in EVENTS) + b": comment\n\n"


def chunked(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


RESPONSES = {
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(SSE, 7),
    "length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SSE) + SSE,
    "close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + SSE,
    "error": b"HTTP/1.1 429 Too Many\r\nContent-Length: 7\r\n\r\nbusy...",
    "cut": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(SSE, 7)[:40],
    # a keep-alive response, then the server closes the idle connection (its idle timeout)
    "idle-close": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(SSE, 7),
}


class Server:
    """Answers each request on a connection with RESPONSES[kind], `step` bytes per write."""

    def __init__(self, kind: str, step: int) -> None:
        self.kind, self.step = kind, step
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                data = RESPONSES[self.kind]
                for i in range(0, len(data), self.step):
                    writer.write(data[i : i + self.step])
                    await writer.drain()
                if self.kind in ("close", "cut", "idle-close"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def _run(kind: str, step: int, requests: int = 2, stale: bool = False) -> tuple[Server, list]:
    server = Server(kind, step)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    client = LeanClient(f"http://127.0.0.1:{port}/prefix", {"authorization": "Bearer k"})
    got: list = []
    try:
        for _ in range(requests):
            if stale and client._idle:  # the close is seen, but the race is lost: reused
                conn = client._idle[0]
                while conn.open:
                    await asyncio.sleep(0.001)
                conn.open = True
            events: list[bytes] = []
            try:
                await client.stream_post(
                    "/v1/x", b'{"a": 1}', lambda p, t, ev=events: ev.append(p), 10
                )
                got.append(events)
            except (HTTPStatusError, ConnectionError) as e:
                got.append(e)
    finally:
        client.close()
        srv.close()
        await srv.wait_closed()
    return server, got


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["chunked", "length", "close"])
async def test_bodies_cut_anywhere_give_the_same_events(kind: str, anyio_backend: str) -> None:
    for step in (1, 2, 3, 5, 8, 13, 64, 4096):
        server, got = await _run(kind, step)
        assert got == [EVENTS, EVENTS], (kind, step)
        # keep-alive: one connection for both requests, unless the server closes each
        assert server.connections == (2 if kind == "close" else 1)
    head = server.requests[0]
    assert head.startswith(b"POST /prefix/v1/x HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in head and head.endswith(b'\r\n\r\n{"a": 1}')


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_error_status_and_a_server_that_leaves(anyio_backend: str) -> None:
    server, got = await _run("error", 3)
    assert all(isinstance(e, HTTPStatusError) and "429" in str(e) for e in got)
    assert "busy..." in str(got[0])
    server, got = await _run("cut", 5)
    assert all(isinstance(e, ConnectionError) for e in got)
    assert server.connections == 2  # a failed connection is not reused


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_kept_alive_connection_the_server_closed_is_not_a_failure(anyio_backend: str):
    """The next request goes on a fresh connection, whether the close has been seen yet or
    the request is written into the closed one first."""
    for stale in (False, True):
        server, got = await _run("idle-close", 4096, requests=3, stale=stale)
        assert got == [EVENTS] * 3
        assert server.connections == 3
