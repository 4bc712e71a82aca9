"""One HTTP inference request's engine requests: admission, output processing, cleanup.

Runs in: the ApiServer process. `/v1/completions` and `/v1/chat/completions` both build a
`Generation` (one `Choice` per prompt x n) and differ only in how they format chunks and the
final body (their subclasses in completions.py and chat.py).

Invariant: `close(cause)` runs exactly once per admitted Generation, synchronously, on every exit
path (normal end, client gone, stall, engine error); it aborts every engine request that has not
finished and does the request accounting in `Metrics` (one finished or aborted per HTTP request).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.responses import Response
from starlette.types import Receive

from vx import messages
from vx.errors import EngineDeadError
from vx.http.detokenizer import TextState
from vx.http.engine_client import EngineBusyError, RequestDelta, RequestStream
from vx.http.errors import APIError, error_body
from vx.http.stream import DONE, SSEResponse, Write, run_until_disconnect, sse_event

if TYPE_CHECKING:
    from vx.http.engine_client import EngineClient
    from vx.http.grammars import GrammarChecker
    from vx.http.metrics import Metrics
    from vx.http.tokenizer import Tokenizer
    from vx.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ENCODER = msgspec.json.Encoder()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServerContext:
    """What every endpoint needs; built once by `build_app`."""

    client: EngineClient
    tokenizer: Tokenizer
    served_model_names: list[str]
    metrics: Metrics
    keepalive_s: float = 15.0
    stall_timeout_s: float = 60.0
    grammars: GrammarChecker | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.model_name if name is None else name
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    def check_available(self) -> None:
        if self.client.is_dead:
            raise APIError(503, "The engine is dead; retry on another replica.", code="engine_dead")
        if self.client.draining:
            raise APIError(503, "The server is shutting down.", code="draining")


@dataclass
class Choice:
    """One engine request: choice `index` of the response, and what it produced so far."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    state: TextState
    prompt_text: str | None = None
    stream: RequestStream | None = None
    lp_token_ids: list[list[int]] = field(default_factory=list)
    lp_values: list[list[float]] = field(default_factory=list)
    #: Completions' `text_offset` of the next logprob token, across stream chunks.
    lp_text_offset: int = 0
    prompt_logprobs: messages.Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    sent_first: bool = False

    @property
    def done(self) -> bool:
        return self.state.finished or self.error is not None


class Generation:
    """The engine requests behind one HTTP request (see the module invariant)."""

    object_name = ""

    def __init__(self, ctx: ServerContext, response_id: str, model: str, choices: list[Choice]):
        self.ctx = ctx
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.choices = choices
        self.include_usage = False
        #: The client's "host:port", for the disconnect log line.
        self.peer: str | None = None
        self._start = time.monotonic()
        self._closed = False

    # ─────────────────────────── lifecycle ───────────────────────────

    def submit(self) -> None:
        """Send every choice to the engine; on failure nothing stays admitted (APIError 503)."""
        client = self.ctx.client
        eos = self.ctx.tokenizer.eos_token_id
        arrival = time.time()
        try:
            for c in self.choices:
                c.stream = client.add_request(
                    messages.AddRequest(
                        request_id=c.request_id,
                        prompt_token_ids=c.prompt_token_ids,
                        sampling_params=c.params,
                        eos_token_id=eos,
                        arrival_time=arrival,
                    )
                )
        except (EngineDeadError, EngineBusyError) as e:
            client.abort_nowait([c.request_id for c in self.choices], "error")
            code = "engine_dead" if isinstance(e, EngineDeadError) else "overloaded"
            raise APIError(503, f"The engine cannot take requests: {e}", code=code) from None
        self.ctx.metrics.prompt_tokens.inc(sum(len(c.prompt_token_ids) for c in self.choices))

    def close(self, cause: str | None) -> None:
        """Abort unfinished engine requests and count this HTTP request once."""
        if self._closed:
            return
        self._closed = True
        unfinished = [c.request_id for c in self.choices if not c.done]
        if unfinished:
            self.ctx.client.abort_nowait(unfinished, cause or "error")
        metrics = self.ctx.metrics
        if cause is None and any(c.error for c in self.choices):
            cause = "error"
        if cause is None and not unfinished:
            reason = self.choices[0].state.finish_reason or "stop"
            metrics.finished(reason, time.monotonic() - self._start)
        else:
            metrics.aborted(cause or "error")
        if cause == "client_disconnect":
            # The wall-clock time lets a test (or an operator) measure detection latency.
            logger.info("client %s left %s: aborted at %.6f", self.peer, self.id, time.time())

    # ─────────────────────────── outputs ───────────────────────────

    async def next_delta(self, c: Choice) -> None:
        """Wait for choice `c`'s next output and fold it into its state."""
        assert c.stream is not None
        try:
            delta = await c.stream.get()
        except anyio.EndOfStream:
            c.error = c.error or "the request ended without a finish reason"
            return
        self._apply(c, delta)

    def _apply(self, c: Choice, delta: RequestDelta) -> None:
        if delta.logprobs:
            c.lp_token_ids.extend(delta.logprob_token_ids)
            c.lp_values.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs = delta.prompt_logprobs
        c.num_cached_tokens = max(c.num_cached_tokens, delta.num_cached_tokens)
        reason = delta.finish_reason
        if reason in (messages.FinishReason.ERROR, messages.FinishReason.ABORT):
            c.state.update(delta.new_token_ids, None)
            c.error = delta.error or f"the engine ended the request ({reason})"
            return
        if c.state.update(delta.new_token_ids, reason, delta.stop_reason):
            # A stop string: a normal finish that only the front knows about.
            self.ctx.client.abort_nowait([c.request_id], "stop_string")

    def usage(self) -> dict[str, int]:
        prompts: dict[int, int] = {}
        for c in self.choices:
            prompts.setdefault(id(c.prompt_token_ids), len(c.prompt_token_ids))
        prompt_tokens = sum(prompts.values())
        completion = sum(len(c.state.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def take_logprob_rows(self, c: Choice) -> tuple[list[list[int]], list[list[float]]]:
        """The rows not streamed yet; a stream keeps no rows it has sent."""
        rows = c.lp_token_ids, c.lp_values
        c.lp_token_ids, c.lp_values = [], []
        return rows

    # ─────────────────────────── formatting (subclasses) ───────────────────────────

    def first_chunks(self, c: Choice) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, c: Choice, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        raise NotImplementedError

    def final_body(self) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    # ─────────────────────────── drivers ───────────────────────────

    def streaming_response(self) -> SSEResponse:
        return SSEResponse(
            self._produce,
            self.close,
            keepalive_s=self.ctx.keepalive_s,
            stall_timeout_s=self.ctx.stall_timeout_s,
        )

    async def _produce(self, write: Write) -> None:
        failed: list[str] = []
        try:
            async with anyio.create_task_group() as tg:
                for c in self.choices:
                    tg.start_soon(self._stream_choice, c, write, failed, tg.cancel_scope)
        except Exception:  # a bug in one request's output processing fails it alone
            logger.exception("request %s failed in the front", self.id)
            failed.append("Internal server error while producing the stream.")
        if failed:
            await write(sse_event(_ENCODER.encode(error_body(500, failed[0]))))
        elif self.include_usage:
            body = self.chunk([])
            body["usage"] = self.usage()
            await write(sse_event(_ENCODER.encode(body)))
        await write(DONE)

    async def _stream_choice(
        self, c: Choice, write: Write, failed: list[str], scope: anyio.CancelScope
    ) -> None:
        first = True
        while not c.done:
            await self.next_delta(c)
            if c.error is not None:
                logger.warning("request %s failed: %s", c.request_id, c.error)
                failed.append(c.error)
                scope.cancel()
                return
            if first:
                # As vLLM does: the role chunk goes out with the first engine output, so a
                # client's time to first chunk measures prefill, not admission.
                first = False
                for body in self.first_chunks(c):
                    await write(sse_event(_ENCODER.encode(body)))
            body = self.delta_chunk(c, c.state.take_delta(), c.state.finish_reason)
            if body is not None:
                await write(sse_event(_ENCODER.encode(body)))

    async def complete(self, receive: Receive) -> Response:
        """Run to the end (non-streaming), aborting if the client leaves first."""
        cause: str | None = "error"
        try:

            async def work() -> None:
                async with anyio.create_task_group() as tg:
                    for c in self.choices:
                        tg.start_soon(self._collect_choice, c, tg.cancel_scope)

            left, _ = await run_until_disconnect(work, receive)
            cause = "client_disconnect" if left else None
        finally:
            self.close(cause)
        if cause is not None:
            return Response(status_code=499)  # nobody is listening; hypercorn drops it
        errors = [c.error for c in self.choices if c.error]
        if errors:
            status = 503 if self.ctx.client.is_dead else 500
            raise APIError(status, errors[0], code="engine_error")
        return Response(_ENCODER.encode(self.final_body()), media_type="application/json")

    async def _collect_choice(self, c: Choice, scope: anyio.CancelScope) -> None:
        while not c.done:
            await self.next_delta(c)
        if c.error is not None:
            scope.cancel()
        c.state.take_delta()
