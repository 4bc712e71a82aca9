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
from vx.http.access_log import AccessRecord
from vx.http.detokenizer import TextState
from vx.http.engine_client import EngineBusyError, RequestDelta, RequestStream
from vx.http.errors import APIError, error_body
from vx.http.stream import DONE, SSEResponse, Write, run_until_disconnect, sse_event
from vx.log import REQUEST_ID, log_request, log_requests_enabled

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from vx.http.engine_client import EngineClient
    from vx.http.grammars import GrammarChecker
    from vx.http.metrics import Metrics
    from vx.http.tokenizer import Tokenizer
    from vx.http.tracing import RequestTracer
    from vx.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ENCODER = msgspec.json.Encoder()


def new_request_id(prefix: str) -> str:
    """`<prefix>-<the HTTP request's id>` (its X-Request-Id, or the one generated for it)."""
    return f"{prefix}-{REQUEST_ID.get() or uuid.uuid4().hex}"


@dataclass
class ServerContext:
    """What every endpoint needs; built once by `build_app`."""

    client: EngineClient
    tokenizer: Tokenizer
    served_model_names: list[str]
    metrics: Metrics
    keepalive_s: float = 15.0
    stall_timeout_s: float = 60.0
    #: One span per generation request (None: tracing off, and nothing of it loaded).
    tracer: RequestTracer | None = None
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
        if not self.client.is_ready:
            raise APIError(503, "The engine is loading the model.", code="loading")


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
        #: The request's access line, filled at `close` (None: no access log layer).
        self.access: AccessRecord | None = None
        #: The request's headers, for the trace's parent (`traceparent`).
        self.headers: list[tuple[bytes, bytes]] = []
        #: The `request_id` of this request's log lines: the HTTP request's id (its
        #: X-Request-Id), as on its access line; the messages name the engine request ids.
        self.log_id = REQUEST_ID.get() or response_id
        self._span: Span | None = None
        self._arrival = 0.0
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
            # Only the choices admitted here: an id may also name another request's stream.
            client.abort_nowait([c.request_id for c in self.choices if c.stream], "error")
            code = "engine_dead" if isinstance(e, EngineDeadError) else "overloaded"
            raise APIError(503, f"The engine cannot take requests: {e}", code=code) from None
        except ValueError:  # a client reused an X-Request-Id that is still in flight
            client.abort_nowait([c.request_id for c in self.choices if c.stream], "error")
            raise APIError(
                409, f"Request id {self.id!r} is already in flight.", code="duplicate_request_id"
            ) from None
        self.ctx.metrics.prompt_tokens.inc(sum(len(c.prompt_token_ids) for c in self.choices))
        self._arrival = arrival
        if self.ctx.tracer is not None:
            operation = "chat" if self.object_name.startswith("chat") else "text_completion"
            self._span = self.ctx.tracer.start(f"{operation} {self.model}", self.headers, arrival)
        for c in self.choices:
            if log_requests_enabled():
                prompt = c.prompt_text if c.prompt_text is not None else c.prompt_token_ids
                log_request(logger, self.log_id, "request %s admitted: %d prompt tokens, "
                            "params %s, prompt %r", c.request_id, len(c.prompt_token_ids),
                            c.params, prompt)  # fmt: skip
            else:
                log_request(logger, self.log_id, "request %s admitted: %d prompt tokens",
                            c.request_id, len(c.prompt_token_ids))  # fmt: skip

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
            log_request(logger, self.log_id, "request %s finished (%s): %d output tokens", self.id,
                        reason, sum(len(c.state.token_ids) for c in self.choices))  # fmt: skip
        else:
            metrics.aborted(cause or "error")
            error = next((c.error for c in self.choices if c.error), None)
            log_request(logger, self.log_id, "request %s aborted (%s)%s", self.id, cause or "error",
                        f": {error}" if error else "")  # fmt: skip
        if self._span is not None:
            self._end_span(cause)
        if self.access is not None:
            usage = self.usage()
            self.access.prompt_tokens = usage["prompt_tokens"]
            self.access.output_tokens = usage["completion_tokens"]
            firsts = [c.stream.first_token_time - c.stream.arrival_time for c in self.choices
                      if c.stream is not None and c.stream.first_token_time is not None]
            self.access.ttft_s = min(firsts) if firsts else None
        if cause == "client_disconnect":
            # The wall-clock time lets a test (or an operator) measure detection latency.
            logger.info("client %s left %s: aborted at %.6f", self.peer, self.id, time.time())

    def _end_span(self, cause: str | None) -> None:
        """The trace's events and GenAI attributes (tracing on only)."""
        assert self.ctx.tracer is not None and self._span is not None
        # The streams' times are monotonic: one offset puts them all on the wall clock.
        to_wall = time.time() - time.monotonic()
        streams = [c.stream for c in self.choices if c.stream is not None]
        scheduled = min((s.scheduled_time for s in streams if s.scheduled_time), default=None)
        firsts = [s.first_token_time for s in streams if s.first_token_time is not None]
        first = min(firsts) + to_wall if firsts else None
        end = time.monotonic() + to_wall
        usage = self.usage()
        params = self.choices[0].params
        error = next((c.error for c in self.choices if c.error), None)
        if error is None and cause is not None:
            error = f"aborted: {cause}"
        attributes = {
            "gen_ai.operation.name": (
                "chat" if self.object_name.startswith("chat") else "text_completion"
            ),
            "gen_ai.system": "vx",
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
            "gen_ai.response.id": self.id,
            "gen_ai.request.id": self.id,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.seed": params.seed,
            "gen_ai.request.choice.count": len(self.choices),
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "gen_ai.response.finish_reasons": [
                c.state.finish_reason or "abort" for c in self.choices
            ],
            "gen_ai.latency.time_in_queue": (
                scheduled - self._arrival if scheduled is not None else None
            ),
            "gen_ai.latency.time_to_first_token": (
                first - self._arrival if first is not None else None
            ),
            "gen_ai.latency.e2e": end - self._arrival,
        }
        events = [("queued", self._arrival), ("scheduled", scheduled), ("first token", first),
                  ("finished", end)]  # fmt: skip
        self.ctx.tracer.end(
            self._span, attributes=attributes, events=events, end_time=end, error=error
        )
        self._span = None

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
                # An engine death is logged once, by the launcher; each request's end is its
                # own (lower) line.
                level = logging.INFO if self.ctx.client.is_dead else logging.WARNING
                logger.log(level, "request %s failed: %s", c.request_id, c.error)
                failed.append(c.error)
                scope.cancel()
                return
            if first:
                # As vLLM does: the role chunk goes out with the first engine output, so a
                # client's time to first chunk measures prefill, not admission.
                first = False
                log_request(logger, self.log_id, "request %s first token", c.request_id)
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
