"""A replica that routers can steer: `vx serve` as a real subprocess, read the way the
Gateway API Inference Extension's endpoint picker reads it (vLLM's metric names on /metrics).
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.e2e.test_serve import metric, wait_for
from tests.models import SERVED, make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: The gauges the model-server protocol reads, under vLLM's names.
VLLM_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", **SERVED)
    with VxServer(model, "--served-model-name", "tiny") as srv:
        yield srv


def _samples(text: str) -> dict[str, float]:
    """{metric name: its value summed over its series} of one Prometheus text scrape."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_vllm_metric_names_follow_the_engine(server: VxServer) -> None:
    """Each gauge is typed `gauge`, labelled by model and engine, and equals its `vx:` twin;
    while a long request runs, running is 1 and KV usage is above 0, and both fall back."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in VLLM_GAUGES:
        assert f"# TYPE {name} gauge" in text, name
        assert f'{name}{{engine="0",model_name="tiny"}}' in text, name
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 1)
        scrape = _samples(httpx.get(server.url + "/metrics", timeout=5).text)
        for name in VLLM_GAUGES:  # one scrape: the twins are the same figure
            assert scrape[name] == scrape[name.replace("vllm:", "vx:")], name
        assert 0 < scrape["vllm:kv_cache_usage_perc"] < 1
        assert scrape["vllm:num_requests_waiting"] == 0
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0)
    assert wait_for(lambda: metric(server.url, "vllm:kv_cache_usage_perc") == 0)
