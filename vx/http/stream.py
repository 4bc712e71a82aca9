"""Server-sent events and client-disconnect detection, at the ASGI level.

Runs in: the ApiServer process.

`SSEResponse` is an ASGI response that runs a producer coroutine (never an async generator, so
no cancel scope ever encloses a `yield`, PEP 789) next to a listener on `receive()`. When the
client leaves (`http.disconnect` from hypercorn, on HTTP/1.1 and HTTP/2 alike, or an `OSError`
from `send` under ASGI 2.4 servers) the producer is cancelled and `on_close(cause)` runs
synchronously, so the engine abort cannot be lost to cancellation. A send that stays blocked
for `stall_timeout_s` (the client stopped reading) ends the stream the same way, with cause
"stall". A comment line goes out after `keepalive_s` of silence so proxies keep the connection.

`run_until_disconnect` gives non-streaming endpoints the same race (starlette itself only watches
streaming responses): it runs the work next to a `receive()` listener and reports whether the
client left first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

#: Seconds without a byte before an SSE comment line is sent.
KEEPALIVE_S = 15.0
#: Seconds one write may stay blocked (the client is not reading) before the stream is aborted.
STALL_TIMEOUT_S = 60.0

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

Write = Callable[[bytes], Awaitable[None]]


# U+0085, U+2028 and U+2029 may stand raw in JSON and in an SSE data line, but line readers
# built on str.splitlines (httpx's `aiter_lines`, and the SSE clients built on it) break a line
# at them and hand the client half a JSON object. Escaped, the JSON means the same.
_LINE_BREAKS_TO_ESCAPE = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse_event(payload: bytes) -> bytes:
    """One `data:` event. `payload` is JSON; the only bytes changed are the three line breaks
    above, which in JSON text can only stand inside strings, so escaping them keeps its value
    and leaves CR and LF (escaped by every JSON encoder) as the only line ends in the event."""
    if b"\xc2\x85" in payload or b"\xe2\x80" in payload:
        for raw, escaped in _LINE_BREAKS_TO_ESCAPE:
            payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"


class SSEResponse:
    """An `text/event-stream` ASGI response driven by `produce(write)`.

    Invariants: `on_close(cause)` is called exactly once, synchronously, on every exit path:
    cause None after a normal end, "client_disconnect", "stall", or "error" (the producer
    raised); writes are serialised, so events from concurrent producers never interleave.
    """

    def __init__(
        self,
        produce: Callable[[Write], Awaitable[None]],
        on_close: Callable[[str | None], None],
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
        keepalive_s: float = KEEPALIVE_S,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        self._produce = produce
        self._on_close = on_close
        self._headers = SSE_HEADERS + (headers or [])
        self._keepalive_s = keepalive_s
        self._stall_timeout_s = stall_timeout_s
        #: Serialises writes (n choices + keep-alive share one ASGI send). A flag and an event
        #: rather than anyio.Lock: an uncontended write then costs no extra scheduling pass.
        self._busy = False
        self._free: anyio.Event | None = None
        self._last_write = time.monotonic()
        #: When the write in progress began (None: no write in progress), for the watchdog.
        self._write_started: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cause: str | None = "error"
        try:
            cause = await self._run(receive, send)
        finally:
            # Sync and first thing on the way out: the abort reaches the ring even when the
            # surrounding scope is cancelled (anyio cancellation is level-triggered).
            self._on_close(cause)

    async def _run(self, receive: Receive, send: Send) -> str | None:
        gone: list[str] = []
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        except OSError:
            return "client_disconnect"
        async with anyio.create_task_group() as tg:

            def leave(cause: str) -> None:
                gone.append(cause)
                tg.cancel_scope.cancel()

            async def write(data: bytes) -> None:
                # A failed write cancels the whole response (producers included) rather than
                # raising, so no exception has to cross the producers' own task groups.
                while self._busy:
                    if self._free is None:
                        self._free = anyio.Event()
                    await self._free.wait()
                self._busy = True
                self._write_started = time.monotonic()
                try:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                except OSError:
                    leave("client_disconnect")
                else:
                    self._last_write = time.monotonic()
                    return
                finally:
                    self._write_started = None
                    self._busy = False
                    if self._free is not None:
                        self._free.set()
                        self._free = None
                await anyio.lowlevel.checkpoint()  # delivers the cancellation just requested

            async def watchdog() -> None:
                # One timer per stream instead of a cancel scope around every write.
                tick = self._stall_timeout_s / 4
                while True:
                    await anyio.sleep(tick)
                    started = self._write_started
                    if started is not None and time.monotonic() - started >= self._stall_timeout_s:
                        leave("stall")
                        return

            async def listen() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        leave("client_disconnect")
                        return

            async def keepalive() -> None:
                while True:
                    await anyio.sleep(self._keepalive_s)
                    if time.monotonic() - self._last_write >= self._keepalive_s:
                        await write(b": keep-alive\n\n")

            async def produce() -> None:
                await self._produce(write)
                tg.cancel_scope.cancel()

            tg.start_soon(listen)
            tg.start_soon(watchdog)
            tg.start_soon(keepalive)
            tg.start_soon(produce)
        if gone:
            return gone[0]
        try:
            with anyio.fail_after(self._stall_timeout_s):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return "client_disconnect"
        except TimeoutError:
            return "stall"
        return None


async def run_until_disconnect(
    work: Callable[[], Awaitable[Any]], receive: Receive
) -> tuple[bool, Any]:
    """Run `work()` while watching `receive()`; returns (client_left, result).

    The request body must have been read already: the listener consumes what `receive` yields.
    When the client leaves first, `work` is cancelled and the result is None.
    """
    result: list[Any] = []
    left = False
    async with anyio.create_task_group() as tg:

        async def listen() -> None:
            nonlocal left
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    left = True
                    tg.cancel_scope.cancel()
                    return

        async def run() -> None:
            result.append(await work())
            tg.cancel_scope.cancel()

        tg.start_soon(listen)
        tg.start_soon(run)
    return left, (result[0] if result else None)
