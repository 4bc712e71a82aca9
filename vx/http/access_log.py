"""AccessLogMiddleware: every HTTP request's id, echoed in `X-Request-Id`, and its access line.

Runs in: the ApiServer process; the outermost ASGI layer, so every response (a 401 or 413 from
an inner layer included) carries the id and gets its line.

The id is the client's `X-Request-Id` when it is a sane token (1-128 characters of
`[A-Za-z0-9._:/+=@-]`: it goes into log lines and the OpenAI `id`), else a fresh uuid4 hex. It is
set in `vx.log.REQUEST_ID` for the task serving the request, so every log line about the request
in the front carries it, and the generation endpoints build their response and engine request
ids from it (`cmpl-<id>`, `cmpl-<id>-<choice>`).

The access line (INFO, logger `vx.access`) is written once the response has ended: method,
path, status, request id, prompt and output tokens and TTFT (generation requests), total time
and the client's address. Off with `--disable-access-log`; ids are echoed either way.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vx.log import REQUEST_ID

logger = logging.getLogger("vx.access")

#: The scope key under which a request's `AccessRecord` travels to the endpoints.
SCOPE_KEY = "vx.access"
_VALID_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


@dataclass(slots=True)
class AccessRecord:
    """What the access line says beyond the status; the generation endpoints fill the counts."""

    request_id: str
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None


def request_id_from(scope: Scope) -> str:
    """The client's X-Request-Id if it is a sane token, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _VALID_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class AccessLogMiddleware:
    """See the module docstring. Invariant: one access line per HTTP request when enabled,
    written after the app returned (or raised), with the status it sent (0: none sent)."""

    def __init__(self, app: ASGIApp, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        record = AccessRecord(request_id)
        scope[SCOPE_KEY] = record
        header = (b"x-request-id", request_id.encode())
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        token = REQUEST_ID.set(request_id)
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.enabled:
                self._log(scope, record, status, time.perf_counter() - start)
            REQUEST_ID.reset(token)

    @staticmethod
    def _log(scope: Scope, record: AccessRecord, status: int, total_s: float) -> None:
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "-"
        tokens = ""
        if record.prompt_tokens is not None:
            ttft = f"{record.ttft_s * 1e3:.1f}" if record.ttft_s is not None else "-"
            tokens = (
                f" prompt_tokens={record.prompt_tokens} output_tokens={record.output_tokens}"
                f" ttft_ms={ttft}"
            )
        logger.info(
            '%s "%s %s" %d request_id=%s%s total_ms=%.1f',
            peer, scope["method"], scope["path"], status, record.request_id, tokens,
            total_s * 1e3,
        )  # fmt: skip
