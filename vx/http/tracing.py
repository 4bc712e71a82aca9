"""RequestTracer: one OpenTelemetry span per generation request, exported over OTLP/HTTP.

Runs in: the ApiServer process, and only with `--otlp-traces-endpoint URL`: the launcher imports
this module then and only then, so a server without tracing loads no OpenTelemetry and pays one
`is None` test per request (`ServerContext.tracer`).

Built on the official `opentelemetry-sdk` and its OTLP/HTTP (protobuf) exporter, with a batch
processor: spans leave from the SDK's own thread, never from the event loop; `shutdown()` flushes
what is left when the server stops.

A span covers one HTTP generation request (every choice), from admission to its end. Its parent
is the client's W3C `traceparent` (and `tracestate`) when given, so vx joins the client's trace.
Events: "queued" (admitted and sent to the engine), "scheduled" (the EngineCore first scheduled
it), "first token" (the first token reached the front), "finished". Attributes follow the
OpenTelemetry GenAI semantic conventions (`gen_ai.request.max_tokens`,
`gen_ai.usage.input_tokens`, ...) plus vLLM's latency attributes (`gen_ai.latency.*`: time in
queue, time to first token, end to end).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import vx

#: Seconds one OTLP export may take (the SDK's default is 10).
EXPORT_TIMEOUT_S = 2.0


def _ns(epoch_s: float) -> int:
    return int(epoch_s * 1e9)


class RequestTracer:
    """Starts and ends request spans. Invariant: every span it starts is ended exactly once by
    `end` (the generation's `close`, which runs once on every path)."""

    def __init__(self, endpoint: str) -> None:
        resource = Resource.create({"service.name": "vx", "service.version": vx.__version__})
        self._provider = TracerProvider(resource=resource)
        # A short export timeout: spans are best effort, and the flush at exit is bounded.
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("vx")
        self._propagator = TraceContextTextMapPropagator()
        self.endpoint = endpoint

    def start(self, name: str, headers: Iterable[tuple[bytes, bytes]], start_time: float) -> Span:
        """A span named `name` from `start_time` (epoch s), child of the request's
        `traceparent` when it carries a valid one."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in headers
            if k in (b"traceparent", b"tracestate")
        }
        context = self._propagator.extract(carrier) if carrier else None
        return self._tracer.start_span(
            name, context=context, kind=SpanKind.SERVER, start_time=_ns(start_time)
        )

    @staticmethod
    def end(
        span: Span,
        *,
        attributes: Mapping[str, Any],
        events: Sequence[tuple[str, float | None]],
        end_time: float,
        error: str | None = None,
    ) -> None:
        """Set the attributes, add the events that happened (time None: did not), end it."""
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        for name, at in events:
            if at is not None:
                span.add_event(name, timestamp=_ns(at))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(end_time))

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (blocks: call from a thread)."""
        self._provider.shutdown()
