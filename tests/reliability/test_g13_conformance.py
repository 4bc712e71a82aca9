"""G13 OpenAI conformance, black box: the official `openai` client and raw httpx against the
shared `vx serve`. Model-independent assertions only (shapes, ids, roles, finish reasons,
usage arithmetic, include_usage semantics, status -> SDK exception class).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.reliability.conftest import figure
from tests.reliability.harness import MODEL_NAME, Served

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FINISH = {"stop", "length"}
MSG = [{"role": "user", "content": "What is the capital of France?"}]


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    return [json.loads(d) for d in data[:-1]]


def _usage_ok(u: dict, completion: int | None = None) -> bool:
    ok = u["prompt_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    return ok and (completion is None or u["completion_tokens"] == completion)


def _check_stream(chunks: list[dict], obj: str, n: int, include_usage: bool, chat: bool) -> None:
    assert len({c["id"] for c in chunks}) == 1, "one id for the whole stream"
    assert {c["object"] for c in chunks} == {obj}
    assert {c["model"] for c in chunks} == {MODEL_NAME}
    body = [c for c in chunks if c["choices"]]
    for i in range(n):
        mine = [ch for c in body for ch in c["choices"] if ch["index"] == i]
        reasons = [ch["finish_reason"] for ch in mine]
        assert reasons[-1] in FINISH and all(r is None for r in reasons[:-1])
        if chat:
            assert mine[0]["delta"].get("role") == "assistant", "first delta carries the role"
            assert all("role" not in ch["delta"] for ch in mine[1:])
    if include_usage:
        assert all(c.get("usage", "absent") is None for c in body), "usage null until the end"
        last = chunks[-1]
        assert last["choices"] == [] and _usage_ok(last["usage"])
    else:
        assert all(c.get("usage") is None for c in chunks)


def test_g13_openai_conformance(shared: Served) -> None:
    checks = mappings = 0
    client = openai.OpenAI(base_url=shared.url + "/v1", api_key="unused", max_retries=0)

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME] and models.data[0].object == "model"
    checks += 1

    c = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=7,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert c.object == "text_completion" and c.id and c.model == MODEL_NAME
    assert c.choices[0].finish_reason == "length" and _usage_ok(c.usage.model_dump(), 7)
    checks += 1

    ch = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=5, n=2,
                                        extra_body={"ignore_eos": True})  # fmt: skip
    assert ch.object == "chat.completion" and ch.id.startswith("chatcmpl")
    assert [x.index for x in ch.choices] == [0, 1]
    assert all(x.message.role == "assistant" and isinstance(x.message.content, str)
               for x in ch.choices)  # fmt: skip
    assert all(x.finish_reason == "length" for x in ch.choices)
    assert _usage_ok(ch.usage.model_dump(), 10)
    checks += 1

    lp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=3,
                                        logprobs=True, top_logprobs=2)  # fmt: skip
    content = lp.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    checks += 1

    stop = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=1)
    assert stop.choices[0].finish_reason in FINISH
    checks += 1

    for include_usage in (False, True):
        body = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 6, "n": 2, "stream": True,
                "ignore_eos": True}  # fmt: skip
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        _check_stream(_sse(shared.url, "/v1/chat/completions", body), "chat.completion.chunk",
                      2, include_usage, chat=True)  # fmt: skip
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 6, "stream": True,
                "ignore_eos": True}  # fmt: skip
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        _check_stream(_sse(shared.url, "/v1/completions", body), "text_completion", 1,
                      include_usage, chat=False)  # fmt: skip
        checks += 2

    # The SDK's streaming decoder accepts our SSE, usage chunk included.
    s = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=4,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage is not None
    checks += 1

    # Status -> SDK exception class (the SDK retries only 408/409/429/5xx: 4xx must be 4xx).
    for exc, kwargs in (
        (openai.BadRequestError, {"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}),
        (openai.BadRequestError, {"model": MODEL_NAME, "prompt": "x", "temperature": 9}),
        (openai.NotFoundError, {"model": "nope", "prompt": "x"}),
    ):
        with pytest.raises(exc) as info:
            client.completions.create(**kwargs)
        err = info.value.body
        assert isinstance(err, dict) and err.get("message") and err.get("type")
        checks += 1
        mappings += 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MSG, stream=True,
                                       max_tokens=100_000)  # fmt: skip
    checks += 1
    mappings += 1
    r = httpx.post(shared.url + "/v1/chat/completions", content=b"{", timeout=10,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    checks += 1
    mappings += 1
    # Every check above asserted as it ran: this line is reached only when all passed (a
    # failure is recorded as a FAIL line by the conftest's report hook).
    figure(f"G13 OpenAI conformance: load {checks} checks (openai SDK + httpx) | faults 0 | "
           f"bad {mappings} error mappings | {checks}/{checks} checks passed")  # fmt: skip
