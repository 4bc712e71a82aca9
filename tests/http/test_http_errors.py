"""Every error class the front answers (400/401/404/405/413/503), auth and CORS."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.conftest import running_app
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio


def assert_envelope(
    r: Any, status: int, *, param: str | None = None, code: str | None = None
) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


BAD_COMPLETIONS: list[tuple[Any, str | None]] = [
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "temperature": 3.0}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "x"}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": 3}}, "stream_options"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
]


async def test_completion_validation_400(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        for body, param in BAD_COMPLETIONS:
            r = await c.post("/v1/completions", json=body)
            assert_envelope(r, 400, param=param)
        for raw in (
            b"{not json",
            b"[1, 2]",
            b"",
            b'{"prompt": "x", "temperature": NaN}',
            b"\xff\xfe",
        ):
            r = await c.post(
                "/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert_envelope(r, 400)
        deep = b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}"
        assert_envelope(await c.post("/v1/completions", content=deep), 400)
        assert not h.engine.adds()
        n = len(BAD_COMPLETIONS) + 6
        assert h.metrics.totals() == {"received": n, "rejected": n, "finished": 0, "aborted": 0}


async def test_chat_validation_400(tokenizer: Tokenizer) -> None:
    bad: list[tuple[Any, str | None]] = [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{}]}, "messages[0].role"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(", "guided_choice": ["a"]}, "guided_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ raise_exception('no') }}"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ]  # fmt: skip
    async with running_app(tokenizer) as h, h.http() as c:
        for body, param in bad:
            assert_envelope(await c.post("/v1/chat/completions", json=body), 400, param=param)
        assert not h.engine.adds()


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_exceeded_is_400_before_any_sse_byte(
    tokenizer: Tokenizer, stream: bool
) -> None:
    async with running_app(tokenizer, max_model_len=16) as h, h.http() as c:
        long_prompt = list(range(5, 25))
        r = await c.post("/v1/completions", json={"prompt": long_prompt, "stream": stream})
        err = assert_envelope(r, 400, param="prompt", code="context_length_exceeded")
        assert "maximum context length is 16 tokens" in err["message"]
        r = await c.post(
            "/v1/completions", json={"prompt": [5, 6], "max_tokens": 15, "stream": stream}
        )
        assert_envelope(r, 400, code="context_length_exceeded")
        r = await c.post(
            "/v1/completions", json={"prompt": [5, 6], "max_tokens": 14, "stream": stream}
        )
        assert r.status_code == 200
        assert len(h.engine.adds()) == 1


async def test_404_405(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        assert_envelope(
            await c.post("/v1/completions", json={"model": "nope", "prompt": "x"}),
            404,
            param="model",
            code="model_not_found",
        )
        assert_envelope(
            await c.post(
                "/v1/chat/completions",
                json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            ),
            404,
            param="model",
        )
        assert_envelope(await c.get("/v1/models/nope"), 404)
        assert_envelope(await c.get("/v1/nothing-here"), 404)
        r = await c.get("/v1/completions")
        assert_envelope(r, 405)
        assert "POST" in r.headers["allow"]
        assert not h.engine.adds()


async def test_body_limit_413(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, max_body_bytes=1000) as h, h.http() as c:
        big = {"prompt": "x" * 2000}
        r = await c.post("/v1/completions", json=big)  # declared Content-Length
        assert_envelope(r, 413, code="request_too_large")

        async def chunks():  # no Content-Length: counted while streaming in
            for _ in range(10):
                yield b" " * 200

        r = await c.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert_envelope(r, 413)
        r = await c.post("/tokenize", content=chunks())
        assert_envelope(r, 413)
        assert (
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        ).status_code == 200
        assert h.metrics.totals() == {"received": 3, "rejected": 2, "finished": 1, "aborted": 0}


async def test_503_when_dead_or_draining(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        h.client.draining = True
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert_envelope(r, 503, code="draining")
        assert r.headers["retry-after"]
        # Draining: not ready, still alive.
        assert_envelope(await c.get("/ready"), 503, code="draining")
        assert (await c.get("/health")).status_code == 200
        h.client.draining = False
        assert (await c.get("/ready")).status_code == 200
        h.engine.die("boom")
        await _until(lambda: h.client.is_dead)
        assert_envelope(await c.get("/health"), 503, code="engine_dead")
        assert_envelope(await c.get("/ready"), 503, code="engine_dead")
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "stream": True},
        )
        assert_envelope(r, 503, code="engine_dead")
        assert r.headers["retry-after"]
        assert 'vx:engine_dead{model_name="tiny"} 1.0' in (await c.get("/metrics")).text


async def _until(predicate: Any) -> None:
    import anyio

    with anyio.fail_after(5):
        while not predicate():
            await anyio.sleep(0.005)


async def test_engine_death_ends_open_streams_with_an_error(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, h.http() as c:
        import anyio

        results: dict[str, Any] = {}

        async def stream_request() -> None:
            results["stream"] = await c.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True},
            )

        async def plain_request() -> None:
            results["plain"] = await c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True}
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_request)
            tg.start_soon(plain_request)
            await h.engine.wait_for_async(lambda e: len(e.running) == 2)
            h.client.mark_dead("worker 0 exited")  # what the launcher does on a dead child
        stream, plain = results["stream"], results["plain"]
        assert stream.status_code == 200
        assert '"error"' in stream.text and "engine dead" in stream.text
        assert stream.text.endswith("data: [DONE]\n\n")
        assert_envelope(plain, 503)
        assert h.metrics.totals() == {"received": 2, "rejected": 0, "finished": 0, "aborted": 2}


async def test_engine_error_for_one_request(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, h.http() as c:
        h.engine.gate.clear()
        import anyio

        async with anyio.create_task_group() as tg:
            out: dict[str, Any] = {}

            async def go() -> None:
                out["r"] = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})

            tg.start_soon(go)
            await h.engine.wait_for_async(lambda e: len(e.running) == 1)
            h.engine.fail_ids.add(next(iter(h.engine.running)))
            h.engine.gate.set()
        assert_envelope(out["r"], 500)
        assert not h.client.is_dead
        ok = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


async def test_auth(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, api_keys=["k1", "second-key"]) as h, h.http() as c:
        assert (await c.get("/health")).status_code == 200  # public
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": "Basic k1"},
            {"x-api-key": "k"},
        ):
            for method, path in (
                ("POST", "/v1/completions"),
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("GET", "/version"),
                ("POST", "/tokenize"),
                ("GET", "/nowhere"),
            ):
                r = await c.request(method, path, headers=headers, json={"prompt": "x"})
                assert_envelope(r, 401, code="invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
        assert (
            await c.get("/v1/models", headers={"authorization": "Bearer k1"})
        ).status_code == 200
        assert (
            await c.get("/v1/models", headers={"Authorization": "bearer second-key"})
        ).status_code == 200
        assert (await c.get("/v1/models", headers={"x-api-key": "second-key"})).status_code == 200
        r = await c.post(
            "/v1/completions",
            headers={"authorization": "Bearer k1"},
            json={"prompt": "x", "max_tokens": 1},
        )
        assert r.status_code == 200
        assert h.metrics.totals() == {"received": 5, "rejected": 4, "finished": 1, "aborted": 0}


async def test_cors(tokenizer: Tokenizer) -> None:
    origin = "https://app.example"
    async with running_app(tokenizer, api_keys=["k"], allowed_origins=[origin]) as h, h.http() as c:
        pre = await c.options(
            "/v1/chat/completions",
            headers={"origin": origin, "access-control-request-method": "POST",
                     "access-control-request-headers": "authorization, content-type"},
        )  # fmt: skip
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == origin
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = await c.get("/v1/models", headers={"origin": origin, "authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == origin
        denied = await c.get("/v1/models", headers={"origin": origin})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == origin
        other = await c.get(
            "/v1/models", headers={"origin": "https://evil.example", "authorization": "Bearer k"}
        )
        assert "access-control-allow-origin" not in other.headers
    async with running_app(tokenizer) as h, h.http() as c:  # no origins: no CORS headers at all
        r = await c.get("/v1/models", headers={"origin": origin})
        assert "access-control-allow-origin" not in r.headers


async def test_too_many_choices(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post("/v1/completions", json={"prompt": ["a"] * 20, "n": 100})
        assert_envelope(r, 400, param="n")
        assert not h.engine.adds()
