"""`vx serve --otlp-traces-endpoint` (issue 54): one span per request, joined to the client's
trace, sent to a real OTLP/HTTP receiver.

The receiver is a small HTTP server in this test (a thread) that decodes each POST with the
`opentelemetry-proto` package's `ExportTraceServiceRequest`, as a collector would.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.models import SERVED, make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class _Receiver(BaseHTTPRequestHandler):
    spans: list[Any] = []
    paths: list[str] = []

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["content-length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        type(self).paths.append(self.path)
        for resource_spans in req.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                type(self).spans.extend(scope_spans.spans)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:  # quiet
        pass


def _attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


def test_one_span_per_request_with_the_clients_trace(tmp_path: Any) -> None:
    model = make_tiny_model(tmp_path, arch="llama", **SERVED)
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.spans, _Receiver.paths = [], []
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    try:
        with VxServer(model, "--served-model-name", "tiny",
                      "--otlp-traces-endpoint", endpoint) as server:  # fmt: skip
            traced = httpx.post(
                server.url + "/v1/completions",
                json={"model": "tiny", "prompt": "hello", "max_tokens": 7},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "t1"},
                timeout=60,
            )
            assert traced.status_code == 200, traced.text
            chat = httpx.post(
                server.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "stream": True},
                headers={"x-request-id": "t2"}, timeout=60,
            )  # fmt: skip
            assert chat.status_code == 200
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        # The server flushed its spans as it stopped (VxServer's exit checked code 0).
    finally:
        receiver.shutdown()
        receiver.server_close()
    spans = {_attrs(s)["gen_ai.response.id"]: s for s in _Receiver.spans}
    # One span per generation request; none for /health or /ready.
    assert sorted(spans) == ["chatcmpl-t2", "cmpl-t1"], sorted(spans)
    assert set(_Receiver.paths) == {"/v1/traces"}
    span = spans["cmpl-t1"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    other = spans["chatcmpl-t2"]
    assert other.trace_id.hex() != TRACE_ID and not other.parent_span_id  # a root of its own
    attrs = _attrs(span)
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert attrs["gen_ai.usage.output_tokens"] == 7 and attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"]
    assert attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert _attrs(other)["gen_ai.operation.name"] == "chat"
    for s in spans.values():
        names = [e.name for e in s.events]
        assert names == ["queued", "scheduled", "first token", "finished"], names
        times = [e.time_unix_nano for e in s.events]
        assert times == sorted(times) and s.start_time_unix_nano <= times[0]
        assert times[-1] <= s.end_time_unix_nano


def test_no_opentelemetry_without_the_flag() -> None:
    """Tracing off costs nothing: the front's modules import no OpenTelemetry."""
    code = (
        "import sys, vx.launch, vx.http.app, vx.http.generation, vx.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    assert out.strip() == "[]", out
