"""Pure ASGI middleware: API-key auth, request-body limit, response accounting.

Runs in: the ApiServer process. None of these wrap `receive` in a way that hides
`http.disconnect` (starlette's BaseHTTPMiddleware does; vLLM #10087), so disconnects still reach
the endpoints. CORS is starlette's own `CORSMiddleware`, which is pure ASGI too.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vx.http.errors import APIError

logger = logging.getLogger(__name__)

#: Routes answered without an API key (deny by default; see reliability.md §1.5).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/"})
#: Request headers (names + values) over this many bytes get 431 (CVE-2025-48956's class).
MAX_HEADER_BYTES = 64 * 1024


#: Called with (path, status) when a middleware refuses a request itself.
OnReject = Callable[[str, int], None]


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _return_freed_heap() -> None:
    """Hands freed heap pages back to the OS after a refused oversized body.

    Up to the limit (32 MiB) of chunks passed through before the refusal; glibc keeps such
    freed 1 MiB chunks in its heap (its mmap threshold rises after the first large free), so
    without a trim each refusal would leave the front's RSS tens of MiB higher. Rare path.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class BodyTooLargeError(Exception):
    """Raised from the wrapped `receive` once a body passes the limit."""


async def _send_error(send: Send, err: APIError) -> None:
    body = err.response()
    await body({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - responses never read
    return {"type": "http.disconnect"}


class AuthMiddleware:
    """Requires `Authorization: Bearer <key>` (or `X-Api-Key`) on every non-public route.

    Invariant: keys are kept only as SHA-256 digests and every presented key is compared with
    every configured digest (`hmac.compare_digest`, no early exit), so the time taken does not
    depend on which key, or how much of one, matched. CORS preflights (OPTIONS) pass through to
    the CORS layer outside this one.
    """

    def __init__(
        self, app: ASGIApp, api_keys: Iterable[str], on_reject: OnReject | None = None
    ) -> None:
        self.app = app
        self._on_reject = on_reject
        self._digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    def _authorized(self, scope: Scope) -> bool:
        presented: bytes | None = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
            elif name == b"x-api-key" and presented is None:
                presented = value.strip()
        if presented is None:
            return False
        digest = hashlib.sha256(presented).digest()
        ok = False
        for expected in self._digests:
            ok |= hmac.compare_digest(digest, expected)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self._digests
            or scope["path"] in PUBLIC_PATHS
            or scope["method"] == "OPTIONS"
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        if self._on_reject is not None:
            self._on_reject(scope["path"], 401)
        await _send_error(
            send,
            APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            ),
        )


class BodyLimitMiddleware:
    """Answers 413 for a body over `max_body_bytes`, before reading it when it can.

    A declared Content-Length over the limit is refused without reading a byte; a body without
    one (chunked, HTTP/2) is counted as it streams in, and refused the moment it passes the
    limit, as long as no response has started.
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, on_reject: OnReject | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._on_reject = on_reject

    def _error(self) -> APIError:
        return APIError(
            413,
            f"The request body is larger than the limit of {self.max_body_bytes} bytes.",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if sum(len(name) + len(value) for name, value in headers) > MAX_HEADER_BYTES:
            if self._on_reject is not None:
                self._on_reject(scope["path"], 431)
            await _send_error(
                send,
                APIError(431, f"The request headers are larger than {MAX_HEADER_BYTES} bytes."),
            )
            return
        for name, value in headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    if self._on_reject is not None:
                        self._on_reject(scope["path"], 400)
                    await _send_error(send, APIError(400, "invalid Content-Length header"))
                    return
                if declared > self.max_body_bytes:
                    if self._on_reject is not None:
                        self._on_reject(scope["path"], 413)
                    await _send_error(send, self._error())
                    return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLargeError
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        rejected = False
        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLargeError:
            if started:
                raise
            rejected = True
        if rejected:
            # Outside the except block, so the traceback's frames (and the chunks they hold)
            # are gone before the heap is trimmed.
            await _send_error(send, self._error())
            _return_freed_heap()


#: An early response (401, 404, 413...) drains at most this much unread request body so the
#: connection stays usable; a larger or unknown remainder closes it (`connection: close`).
DRAIN_BODY_BYTES = 64 * 1024
DRAIN_BODY_S = 1.0


class ResponseCounterMiddleware:
    """Counts every HTTP response by route template and status (for /metrics).

    It also keeps HTTP/1.1 keep-alive honest: a response that starts before the request body
    was read (auth, routing and limit errors) first drains a small remainder, or else says
    `connection: close`. Without this, hypercorn drops such a connection after the response
    and the client's next request on it fails with "server disconnected" (found by G10).
    """

    def __init__(self, app: ASGIApp, record: Callable[[str, int], None], paths: set[str]) -> None:
        self.app = app
        self._record = record
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self._paths else "other"
        body_done = False

        async def tracking_receive() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_done = True
            return message

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._record(path, int(message["status"]))
                if not body_done and not await _drain(scope, tracking_receive, lambda: body_done):
                    headers = [*message.get("headers", ()), (b"connection", b"close")]
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, tracking_receive, counting_send)


async def _drain(scope: Scope, receive: Receive, done: Callable[[], bool]) -> bool:
    """Read and drop a small unread request body; False when it is too big or too slow."""
    headers = dict(scope.get("headers", ()))
    declared = headers.get(b"content-length")
    if declared is None and b"transfer-encoding" not in headers:
        return True  # no body at all
    if declared is None or not declared.isdigit() or int(declared) > DRAIN_BODY_BYTES:
        return False
    with anyio.move_on_after(DRAIN_BODY_S):
        while not done():
            await receive()
    return done()


def chain(app: ASGIApp, *layers: tuple[Any, dict[str, Any]]) -> ASGIApp:
    """Wrap `app` in `layers`, the first listed ending up outermost."""
    for cls, kwargs in reversed(layers):
        app = cls(app, **kwargs)
    return app
