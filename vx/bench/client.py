"""A lean HTTP/1.1 streaming client for `vx bench serve`: one asyncio Protocol per connection.

Runs in: the load generator's process. The load generator shares the machine with the server
it measures, so what it spends per streamed token is taken from the server: through httpx
(httpcore, anyio streams, a cancel scope per read) it took a sizeable share of a core at
concurrency 64 on two cores, in bursts that stall the server's threads (docs/performance.md,
"Method"). Here each read is parsed where it lands (`data_received`: HTTP/1.1 chunked or
length-delimited bodies, SSE lines split at LF as the SSE grammar says), and each event's
arrival time is the time of the read that completed it, as with any streaming client.

Invariants: one request at a time per connection, which is reused (keep-alive) until the server
closes it or a request fails; `stream_post()` returns after a whole response or raises, and a
connection is only reused after a whole 200 response, so no request is left half-read on it.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Callable

#: on_event(payload, t): one SSE `data:` payload (bytes, without "data:"), and the
#: perf_counter time of the read that completed it.
OnEvent = Callable[[bytes, float], None]


class HTTPStatusError(Exception):
    """A response other than 200, with the start of its body."""


class _Conn(asyncio.Protocol):
    """Invariant: `done` is set (once) per request, by the end of its body, a parse error or
    the connection's loss; after that nothing is parsed until the next request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.done: asyncio.Future[None] | None = None
        self.on_event: OnEvent | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self.done is not None and not self.done.done():
            if self.state == "close":  # a body delimited by the connection's end
                self._feed(b"", time.perf_counter(), final=True)
                self.done.set_result(None)
            else:
                self.done.set_exception(ConnectionError(exc or "the server closed the connection"))

    def start(self, head: bytes, body: bytes, on_event: OnEvent) -> asyncio.Future[None]:
        assert self.transport is not None
        self.status = 0  # no response yet (stream_post retries a reused connection on that)
        if self.transport.is_closing():  # lost since it went idle
            raise ConnectionError("the connection was closed while idle")
        self.buf = bytearray()
        self.lines = bytearray()  # body bytes not yet split into SSE lines
        self.state = "head"
        self.remaining = 0
        self.keep_alive = True
        self.error_body = bytearray()
        self.on_event = on_event
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        return self.done

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            return
        now = time.perf_counter()
        self.buf += data
        try:
            self._parse(now)
        except (ValueError, IndexError) as e:
            self.done.set_exception(ValueError(f"bad HTTP response: {e}"))
            self.keep_alive = False

    def _parse(self, now: float) -> None:
        buf = self.buf
        while not self.done.done():  # type: ignore[union-attr]
            if self.state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buf[:end]).split(b"\r\n")
                del buf[: end + 4]
                self.status = int(lines[0].split(None, 2)[1])
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(b":")
                    headers[k.strip().lower()] = v.strip().lower()
                self.keep_alive = headers.get(b"connection") != b"close"
                if b"chunked" in headers.get(b"transfer-encoding", b""):
                    self.state = "size"
                elif b"content-length" in headers:
                    self.state, self.remaining = "length", int(headers[b"content-length"])
                else:
                    self.state, self.keep_alive = "close", False
            elif self.state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                self.remaining = int(bytes(buf[:end]).split(b";")[0], 16)
                del buf[: end + 2]
                self.state = "data" if self.remaining else "trailer"
            elif self.state in ("data", "length", "close"):
                take = len(buf) if self.state == "close" else min(self.remaining, len(buf))
                if take:
                    self._feed(bytes(buf[:take]), now)
                    del buf[:take]
                    self.remaining -= take
                if self.state == "close" or (self.remaining and not buf):
                    return
                if self.state == "length":
                    if self.remaining == 0:
                        self._finish(now)
                    return
                self.state = "crlf"
            elif self.state == "crlf":
                if len(buf) < 2:
                    return
                del buf[:2]
                self.state = "size"
            elif self.state == "trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:  # the blank line after the (usually absent) trailer fields
                    self._finish(now)

    def _finish(self, now: float) -> None:
        self._feed(b"", now, final=True)
        self.done.set_result(None)  # type: ignore[union-attr]

    def _feed(self, data: bytes, now: float, final: bool = False) -> None:
        if self.status != 200:
            self.error_body += data[: max(0, 200 - len(self.error_body))]
            return
        lines = self.lines
        lines += data
        if final and lines and not lines.endswith(b"\n"):
            lines += b"\n"
        start = 0
        while (end := lines.find(b"\n", start)) >= 0:
            line = bytes(lines[start:end]).removesuffix(b"\r")
            start = end + 1
            if line.startswith(b"data:"):
                self.on_event(line[5:].strip(), now)  # type: ignore[misc]
        del lines[:start]


class LeanClient:
    """POSTs that stream SSE back, over keep-alive HTTP/1.1 connections to one server.

    Each concurrent caller takes a connection from the idle list (or opens one) and gives it
    back after a complete response."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"the lean client speaks plain http only, not {u.scheme!r}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {u.netloc}\r\nContent-Type: application/json\r\n{extra}"
        self._idle: list[_Conn] = []

    async def stream_post(self, path: str, body: bytes, on_event: OnEvent, timeout: float) -> None:
        """Sends `body`, calls `on_event` per SSE data line until the response ends. Raises
        HTTPStatusError for a status other than 200, ConnectionError, ValueError (a response
        it cannot parse) or TimeoutError."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        while self._idle:
            conn = self._idle.pop()
            if not conn.open:
                continue
            try:
                return await self._send(conn, head, body, on_event, timeout)
            except ConnectionError:
                # A kept-alive connection the server closed before answering (its idle
                # timeout): the request never started there, so it goes on a fresh one.
                if conn.status:
                    raise
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        await self._send(conn, head, body, on_event, timeout)

    async def _send(
        self, conn: _Conn, head: bytes, body: bytes, on_event: OnEvent, timeout: float
    ) -> None:
        ok = False
        try:
            async with asyncio.timeout(timeout):
                await conn.start(head, body, on_event)
            ok = True
        finally:
            if ok and conn.keep_alive and conn.open and conn.status == 200:
                self._idle.append(conn)
            elif conn.transport is not None:
                conn.transport.close()
        if conn.status != 200:
            raise HTTPStatusError(f"HTTP {conn.status}: {bytes(conn.error_body)!r}")

    def close(self) -> None:
        for c in self._idle:
            if c.transport is not None:
                c.transport.close()
        self._idle.clear()
