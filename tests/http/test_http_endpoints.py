"""Every endpoint of the front, in process (httpx's ASGI transport), on a fake engine."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.http.conftest import MODEL, REPLY, running_app
from vx import messages
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body into JSON objects, with the literal "[DONE]" kept as a string."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return events


async def test_completion_string_prompt(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 64}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == MODEL
        (choice,) = body["choices"]
        assert choice["text"] == REPLY and choice["finish_reason"] == "stop"
        n_reply = len(tokenizer.encode(REPLY, add_special_tokens=False))
        prompt_ids = tokenizer.encode("Hello")
        assert body["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n_reply + 1,  # + EOS
            "total_tokens": len(prompt_ids) + n_reply + 1,
        }
        (add,) = h.engine.adds()
        assert add.prompt_token_ids == prompt_ids
        assert add.eos_token_id == tokenizer.eos_token_id
        assert add.sampling_params.max_tokens == 64


async def test_completion_length_and_default_max_tokens(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post("/v1/completions", json={"prompt": "Hello"})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default
        r = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": None})
        assert h.engine.adds()[-1].sampling_params.max_tokens == 256 - len(
            tokenizer.encode("Hello")
        )


@pytest.mark.parametrize(
    "prompt",
    [["Hello", "one two"], [5, 6, 7], [[5, 6], [7, 8, 9]]],
    ids=["strings", "token-ids", "token-id-lists"],
)
async def test_completion_prompt_forms(tokenizer: Tokenizer, prompt: Any) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "n": 2})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        num_prompts = 1 if isinstance(prompt[0], int) else len(prompt)
        assert [ch["index"] for ch in choices] == list(range(2 * num_prompts))
        adds = h.engine.adds()
        assert len(adds) == 2 * num_prompts
        if isinstance(prompt[0], list):
            assert [a.prompt_token_ids for a in adds] == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
        assert r.json()["usage"]["prompt_tokens"] == sum(len(a.prompt_token_ids) for a in adds[::2])


async def test_n_fans_out_with_seed_plus_index(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "Hi", "n": 3, "seed": 41, "max_tokens": 2, "temperature": 0.7,
                  "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        adds = h.engine.adds()
        rid = r.json()["id"]
        assert [a.request_id for a in adds] == [f"{rid}-0", f"{rid}-1", f"{rid}-2"]
        assert [a.sampling_params.seed for a in adds] == [41, 42, 43]
        p = adds[0].sampling_params
        assert (p.temperature, p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (
            0.7,
            5,
            0.1,
            1.1,
            True,
        )


async def test_completion_echo_and_logprobs(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "one two", "max_tokens": 3, "echo": True, "logprobs": 2},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"].startswith("one two")
        lp = choice["logprobs"]
        n_prompt = len(tokenizer.encode("one two"))
        assert len(lp["tokens"]) == n_prompt + 3
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1] == -2.0
        assert lp["token_logprobs"][n_prompt:] == [-0.5, -0.5, -0.5]
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert len(lp["top_logprobs"][-1]) >= 1
        assert h.engine.adds()[0].sampling_params.prompt_logprobs == 2


async def test_completion_stream_echo_logprobs_per_choice(tokenizer: Tokenizer) -> None:
    """Streamed with echo, each choice's first chunk carries the prompt's logprob rows (the
    stream then drops them), and the rows of the rest follow in order."""
    async with running_app(tokenizer, step_s=0.001) as h, h.http() as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "one two", "max_tokens": 3, "echo": True, "logprobs": 2, "n": 2,
                  "stream": True},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        n_prompt = len(tokenizer.encode("one two"))
        tokens: dict[int, list[str]] = {0: [], 1: []}
        values: dict[int, list[Any]] = {0: [], 1: []}
        for event in sse_events(r.text)[:-1]:
            for choice in event["choices"]:
                lp = choice["logprobs"]
                if lp is not None:
                    tokens[choice["index"]] += lp["tokens"]
                    values[choice["index"]] += lp["token_logprobs"]
        for i in (0, 1):
            assert len(tokens[i]) == n_prompt + 3
            assert values[i][0] is None and values[i][1] == -2.0
            assert values[i][n_prompt:] == [-0.5, -0.5, -0.5]


async def test_completion_stream(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.001) as h, h.http() as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 64, "stream": True, "logprobs": 1,
                  "stream_options": {"include_usage": True}},
        )  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        assert len({e["id"] for e in events[:-1]}) == 1
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == REPLY
        assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "stop"
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
        assert all(ch["usage"] is None for ch in chunks)
        tokens = [
            t
            for ch in chunks
            if ch["choices"][0]["logprobs"]
            for t in ch["choices"][0]["logprobs"]["tokens"]
        ]
        assert len(tokens) == usage["usage"]["completion_tokens"]


async def test_stream_escapes_the_line_breaks_splitlines_knows(tokenizer: Tokenizer) -> None:
    """U+2028, U+2029 and U+0085 in the text go out escaped, so a reader that splits at every
    break str.splitlines knows (httpx's `aiter_lines`, found cutting a data line in two by a
    GPU run) still gets whole JSON lines, and the text is unchanged."""
    reply = "a\u2028b\x85c\u2029d \u2019e"
    async with running_app(tokenizer, reply=reply) as h, h.http() as c:
        body = {"prompt": "Hello", "max_tokens": 64, "stream": True}
        for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"chat": 1})):
            if extra:
                body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
            async with c.stream("POST", path, json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            events = [msgspec.json.decode(line[len("data: ") :]) for line in lines[:-1]]
            if extra:
                text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            else:
                text = "".join(e["choices"][0]["text"] for e in events)
            assert text == reply


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string(tokenizer: Tokenizer, stream: bool) -> None:
    async with running_app(tokenizer, step_s=0.001) as h, h.http() as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 64, "stop": "ee fo", "stream": stream},
        )
        assert r.status_code == 200
        if stream:
            chunks = sse_events(r.text)[:-1]
            text = "".join(ch["choices"][0]["text"] for ch in chunks)
            finish = chunks[-1]["choices"][0]
        else:
            finish = r.json()["choices"][0]
            text = finish["text"]
        expected = REPLY[: REPLY.index("ee fo")]
        assert text == expected
        assert finish["finish_reason"] == "stop" and finish["stop_reason"] == "ee fo"
        # The engine does not know stop strings: the front aborts the request, as a finish
        # (unless the engine's own EOS arrived in the same merged delta: then nothing to abort).
        await h.engine.wait_for_async(lambda e: not e.running)
        assert h.engine.aborted_ids() in ([], [h.engine.adds()[0].request_id])
        assert set(h.engine.aborted_ids()) == set(h.engine.aborted_ids("stop_string"))
        totals = h.metrics.totals()
        assert totals["finished"] == 1 and totals["aborted"] == 0


async def test_chat_completion(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  "max_completion_tokens": 40, "n": 2, "logprobs": True, "top_logprobs": 2},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert [ch["message"] for ch in body["choices"]] == [
            {"role": "assistant", "content": REPLY}
        ] * 2
        entry = body["choices"][0]["logprobs"]["content"][0]
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] == -0.5
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )
        adds = h.engine.adds()
        assert adds[0].prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
        assert adds[0].sampling_params.max_tokens == 40 and adds[0].sampling_params.logprobs == 2


async def test_chat_stream_shape(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.001) as h, h.http() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
                  "stream_options": {"include_usage": True}, "max_tokens": 64},
        )  # fmt: skip
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        chunks = events[:-2]
        assert len({e["id"] for e in events[:-1]}) == 1
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        for index in (0, 1):
            mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == index]
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(m["delta"].get("content", "") for m in mine[1:]) == REPLY
            assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
            assert mine[-1]["finish_reason"] == "stop"
            assert all("role" not in m["delta"] for m in mine[1:])


async def test_models_health_version_tokenize(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
        assert (await c.get(f"/v1/models/{MODEL}")).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/version")).json()["version"]
        assert (await c.get("/")).json()["models"] == [MODEL]
        t = (
            await c.post("/tokenize", json={"prompt": "one two", "return_token_strs": True})
        ).json()
        assert t["tokens"] == tokenizer.encode("one two") and t["count"] == len(t["tokens"])
        assert t["max_model_len"] == 256 and len(t["token_strs"]) == t["count"]
        chat = (
            await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        ).json()
        assert tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith("assistant\n")
        d = (await c.post("/detokenize", json={"tokens": t["tokens"]})).json()
        assert d == {"prompt": "one two"}
        schema = (await c.get("/openapi.json")).json()
        assert {"/v1/completions", "/v1/chat/completions", "/health", "/metrics"} <= set(
            schema["paths"]
        )
        assert "CompletionRequest" in schema["components"]["schemas"]


async def test_metrics(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.001) as h, h.http() as c:
        await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 0})
        text = (await c.get("/metrics")).text
        for name in (
            "vx:num_requests_running", "vx:num_requests_waiting", "vx:kv_cache_usage_perc",
            "vx:prefix_cache_queries_total", "vx:prefix_cache_hits_total", "vx:num_preemptions_total",
            "vx:time_to_first_token_seconds_bucket", "vx:inter_token_latency_seconds_bucket",
            "vx:e2e_request_latency_seconds_bucket", "vx:prompt_tokens_total",
            "vx:generation_tokens_total", "vx:request_success_total", "vx:request_aborted_total",
            "vx:requests_received_total", "vx:requests_rejected_total",
        ):  # fmt: skip
            assert name in text, name
        assert 'vx:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
        assert 'vx:requests_rejected_total{model_name="tiny",status="400"} 1.0' in text
        assert 'vx:generation_tokens_total{model_name="tiny"} 5.0' in text
        assert h.metrics.totals() == {"received": 2, "rejected": 1, "finished": 1, "aborted": 0}


async def test_utility_calls_and_stats(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h:
        assert await h.client.call_utility("get_stats") == {"num_running": 0}
        with pytest.raises(RuntimeError, match="unknown method"):
            await h.client.call_utility("nope")
        assert h.client.max_model_len == 256 and h.client.ready[0].engine_index == 0


async def test_reset_prefix_cache_is_a_dev_endpoint(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served only with VX_SERVER_DEV_MODE=1 (vLLM's gate); 409 naming the busy engine while a
    request runs there, 400 for vLLM's preempting variant, 200 once every engine reset."""
    async with running_app(tokenizer) as h, h.http() as c:
        assert (await c.post("/reset_prefix_cache")).status_code == 404
    monkeypatch.setenv("VX_SERVER_DEV_MODE", "1")
    async with running_app(tokenizer, num_engines=2) as h, h.http() as c:
        for e in h.engines:  # type: ignore[attr-defined]
            e.gate.clear()  # a request stays running
        params = msgspec.convert({"max_tokens": 4}, type=messages.SamplingParams)
        stream = h.client.add_request(
            messages.AddRequest(request_id="r", prompt_token_ids=[5], sampling_params=params)
        )
        busy = h.engines[stream.engine_index]  # type: ignore[attr-defined]
        await busy.wait_for_async(lambda e: bool(e.running))
        r = await c.post("/reset_prefix_cache")
        assert r.status_code == 409, r.text
        assert f"[{stream.engine_index}]" in r.json()["error"]["message"], r.text
        r = await c.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        assert r.status_code == 400, r.text
        h.client.abort_nowait([stream.request_id], "client_disconnect")
        await busy.wait_for_async(lambda e: not e.running)
        r = await c.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"ok": True}, r.text


async def test_data_parallel_routes_to_least_loaded(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, num_engines=2) as h:
        h.engines[0].gate.clear()  # type: ignore[attr-defined]
        h.engines[1].gate.clear()  # type: ignore[attr-defined]
        params = msgspec.convert({"max_tokens": 4}, type=messages.SamplingParams)
        streams = [
            h.client.add_request(
                messages.AddRequest(
                    request_id=f"r{i}", prompt_token_ids=[5], sampling_params=params
                )
            )
            for i in range(4)
        ]
        assert sorted(s.engine_index for s in streams) == [0, 0, 1, 1]
        h.client.abort_nowait([s.request_id for s in streams], "client_disconnect")
        for e in h.engines:  # type: ignore[attr-defined]
            await e.wait_for_async(lambda e: len(e.aborted_ids()) == 2)
        assert h.client.num_unfinished == 0


async def test_stop_string_aborts_the_engine_request(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.002) as h, h.http() as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                  "ignore_eos": True, "stop": ["ee fo"], "n": 2, "stream": True},
        )  # fmt: skip
        assert r.status_code == 200
        await h.engine.wait_for_async(lambda e: not e.running)
        assert sorted(h.engine.aborted_ids("stop_string")) == sorted(
            a.request_id for a in h.engine.adds()
        )
        assert h.metrics.totals() == {"received": 1, "rejected": 0, "finished": 1, "aborted": 0}
