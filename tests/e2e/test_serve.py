"""`vx serve` as a real subprocess, driven by real clients: the openai client, httpx over
HTTP/1.1 and HTTP/2 (h2c), and curl. Covers the main endpoints, streaming, and client
disconnects on both protocols freeing the request's KV blocks.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.models import SERVED, make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # SERVED: a bf16 checkpoint, served with no --dtype: the default path (see the next test)
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", **SERVED)
    with VxServer(model, "--served-model-name", "tiny") as srv:
        yield srv


def test_greedy_request_takes_the_fused_step(server: VxServer) -> None:
    """A served greedy request runs the default CPU path: its one-row decode steps take the
    fused greedy step (every layer, the final norm and the LM head's argmax in one C call),
    which the Worker logs at its first such step (`StepSampler.path_steps`)."""
    from vx.gpu.cpu.library import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("vx's C kernels are not built here (no compiler): no fused step to take")
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    line = "tokens by the fused greedy step: first step, of 1 row(s)"
    assert wait_for(lambda: line in server.full_log()), server.log()


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)  # polling a remote server's metrics
    return cond()


def test_openai_client_completions_and_chat(server: VxServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["tiny"]
    c = client.completions.create(model="tiny", prompt="hello world", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8
    again = client.completions.create(model="tiny", prompt="hello world", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == c.choices[0].text  # greedy is deterministic
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, temperature=0, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices][-1] == "length"


def test_http2_prior_knowledge_stream(server: VxServer) -> None:
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 5, "stream": True,
            "ignore_eos": True}
    with httpx.Client(http1=False, http2=True, base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.http_version == "HTTP/2"
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_http2_prior_knowledge(server: VxServer) -> None:
    version = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout
    if "HTTP2" not in version:
        pytest.skip("this curl has no HTTP/2 support")
    out = subprocess.run(
        ["curl", "-sS", "--http2-prior-knowledge", "-N", server.url + "/v1/chat/completions",
         "-H", "content-type: application/json", "-d",
         json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 4, "stream": True})],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert out.stdout.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])
def test_disconnect_frees_blocks(server: VxServer, http2: bool, stream: bool) -> None:
    before = metric(server.url, "vx:request_aborted_total", cause="client_disconnect")
    body = {"model": "tiny", "prompt": "a b c d e f g h", "max_tokens": 480,
            "ignore_eos": True, "stream": stream}
    client = httpx.Client(http1=not http2, http2=http2, base_url=server.url, timeout=30)
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                break  # one chunk arrived: the request is decoding; now leave
    else:
        with pytest.raises(httpx.ReadTimeout):
            # Far shorter than 480 tokens take even on a quiet machine (0.15 s was not, on a
            # 2-core Zen 5: ~3,000 tok/s for this model): we leave mid-decode.
            client.post("/v1/completions", json=body, timeout=0.03)
    client.close()
    assert wait_for(lambda: metric(server.url, "vx:request_aborted_total",
                                   cause="client_disconnect") == before + 1)
    assert wait_for(lambda: metric(server.url, "vx:kv_cache_usage_perc") == 0.0)
    assert metric(server.url, "vx:num_requests_running") == 0


def test_errors_use_openai_envelope(server: VxServer) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                         "temperature": "hot"})
    assert r.status_code == 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_tokenize_roundtrip_and_version(server: VxServer) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "hello world"}).json()
    text = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": ids["tokens"]}).json()
    assert re.sub(r"\s+", " ", text["prompt"]).strip().endswith("hello world")
    assert "version" in httpx.get(server.url + "/version").json()
