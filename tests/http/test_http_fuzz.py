"""Property: whatever JSON a client sends, the front answers 2xx or a 4xx in OpenAI's envelope.

Runs the app on a fake engine inside an anyio blocking portal (one event loop for the whole
test), so hypothesis can drive it from a plain function. Bodies mix the real field names with
arbitrary JSON values, so most examples reach the validators rather than dying at parse time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.http.conftest import Harness, running_app
from vx.http.tokenizer import Tokenizer

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
    "top_p", "top_k", "min_p", "stream", "stream_options", "stop", "seed", "logprobs",
    "top_logprobs", "echo", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "prompt_logprobs", "response_format", "best_of", "suffix",
]  # fmt: skip

json_leaf = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | st.sampled_from(["tiny", "hi", "user", "text", ""])
)  # fmt: skip
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "include_usage", "5"])
            | st.text(max_size=5),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "other"]),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 500), max_size=8)),
    "messages": st.just([{"role": "user", "content": "hi"}]),
    "max_tokens": st.integers(-2, 80) | st.none(),
    "max_completion_tokens": st.integers(-2, 80),
    "n": st.integers(0, 3),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(0, 1.5),
    "top_k": st.integers(-3, 50),
    "min_p": st.floats(0, 1.5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "seed": st.integers(-(2**64), 2**64),
    "logprobs": st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "echo": st.booleans(),
    "logit_bias": st.dictionaries(
        st.sampled_from(["5", "x", "-1", "99999"]), st.floats(-200, 200), max_size=2
    ),
    "stop_token_ids": st.lists(st.integers(-1, 1000), max_size=3),
    "min_tokens": st.integers(-1, 100),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 3),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["prompt"] = draw(PLAUSIBLE["prompt"])
    if draw(st.booleans()):
        body["messages"] = draw(PLAUSIBLE["messages"] | json_value)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        plausible = PLAUSIBLE.get(name)
        wild = draw(st.integers(0, 3)) == 0 or plausible is None
        body[name] = draw(json_value if wild else plausible)
    return body


@pytest.fixture(scope="module")
def live(tokenizer: Tokenizer) -> Iterator[tuple[Any, Harness]]:
    with start_blocking_portal("asyncio") as portal:
        cm = portal.wrap_async_context_manager(running_app(tokenizer, max_model_len=64))
        with cm as harness:
            yield portal, harness


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=bodies(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"])
)
def test_any_json_gets_a_4xx_or_success(
    live: tuple[Any, Harness], body: dict[str, Any], path: str
) -> None:
    portal, h = live

    async def call() -> tuple[int, bytes, str]:
        async with h.http(timeout=30) as c:
            r = await c.post(
                path,
                content=msgspec.json.encode(body),
                headers={"content-type": "application/json"},
            )
            return r.status_code, r.content, r.headers.get("content-type", "")

    status, content, ctype = portal.call(call)
    assert status < 500, (status, content[:300])
    if status >= 400:
        assert status in (400, 404, 413) and ctype == "application/json"
        err = msgspec.json.decode(content)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == "invalid_request_error"
    assert not h.client.is_dead
