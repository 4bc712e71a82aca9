"""Structured outputs and tool calls through a real `vx serve`, with the official `openai` client.

The default model (SmolLM2-135M-Instruct) at temperature 1 writes whatever it likes; the
grammar alone makes every output valid, so each test checks validity, not content. The tiny
random model serves the compile-timeout test (its server starts fast) and `vx.LLM`.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from typing import Annotated, Literal

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.models import SERVED, make_tiny_model

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server():
    with VxServer(MODEL, "--max-model-len", "2048", "--chat-template", "chatml_tools",
                  startup_timeout_s=500) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server: VxServer):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Employee(pydantic.BaseModel):
    """Nested objects, an array of objects, an enum, required and optional fields."""

    name: str = pydantic.Field(max_length=20)
    level: Literal["junior", "senior", "lead"]
    address: Address
    skills: list[Annotated[str, pydantic.Field(max_length=16)]] = pydantic.Field(max_length=3)
    manager: str | None = pydantic.Field(default=None, max_length=20)
    past: list[Address] = pydantic.Field(max_length=2)


def test_parse_with_a_pydantic_model_gives_20_of_20(client) -> None:
    def one(i: int):
        return client.chat.completions.parse(
            model=MODEL, messages=_ask(f"Invent employee number {i} of a small company."),
            response_format=Employee, temperature=1.0, max_tokens=400,
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(20)))
    for r in results:
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Employee), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"


def test_json_schema_n3_and_streamed_n2_validate(client) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=_ask("A person, as JSON."),
                                       response_format=rf, n=3, max_tokens=300)  # fmt: skip
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema_rs.validate(PERSON_SCHEMA, json.loads(c.message.content))
    stream = client.chat.completions.create(model=MODEL, messages=_ask("A person, as JSON."),
                                            response_format=rf, n=2, max_tokens=300,
                                            stream=True)  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts.values():
        jsonschema_rs.validate(PERSON_SCHEMA, json.loads(text))


def test_regex_and_choice_match_streamed_and_not(client) -> None:
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    stream = client.chat.completions.create(
        model=MODEL, messages=_ask("Give a product code."), n=2, max_tokens=40, stream=True,
        extra_body={"structured_outputs": {"regex": pattern}},
    )  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(re.fullmatch(pattern, t) for t in texts.values()), texts
    choices = ["sunny", "rainy", "snowy"]
    r = client.completions.create(model=MODEL, prompt="Tomorrow the weather will be", n=3,
                                  max_tokens=10, extra_body={"guided_choice": choices})  # fmt: skip
    assert all(c.text in choices for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=10,
                                  extra_body={"guided_regex": "(yes|no)!"})  # fmt: skip
    assert r.choices[0].text in ("yes!", "no!")
    grammar = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'
    r = client.completions.create(model=MODEL, prompt="Some numbers:", max_tokens=30,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_valid_calls_of_two_tools(client, stream: bool) -> None:
    messages = _ask("What is the weather in Paris, and what is 2 + 3?")
    seen: set[str] = set()
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=300, n=2,
                                           stream=stream)  # fmt: skip
        calls: dict[tuple[int, int], dict[str, str]] = {}
        reasons = {}
        if stream:
            for chunk in r:
                for c in chunk.choices:
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
                    for tc in c.delta.tool_calls or []:
                        call = calls.setdefault((c.index, tc.index), {"name": "", "args": ""})
                        if tc.function.name:
                            assert not call["name"] and tc.id
                            call["name"] = tc.function.name
                        call["args"] += tc.function.arguments or ""
        else:
            for c in r.choices:
                reasons[c.index] = c.finish_reason
                for j, tc in enumerate(c.message.tool_calls or []):
                    assert tc.id and tc.type == "function"
                    calls[(c.index, j)] = {"name": tc.function.name, "args": tc.function.arguments}
        # The model may repeat calls until max_tokens: every call it finished still counts.
        assert set(reasons) == {0, 1} and set(reasons.values()) <= {"tool_calls", "length"}
        assert {i for i, _ in calls} == {0, 1}
        for call in calls.values():
            jsonschema_rs.validate(TOOL_SCHEMAS[call["name"]], json.loads(call["args"]))
            seen.add(call["name"])
    assert seen  # the names come from the grammar's enum of the two tools


def test_named_tool_choice_and_a_tool_turn(client) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=MODEL, messages=_ask("Add 2 and 3."), tools=TOOLS,
                                       tool_choice=named, max_tokens=100)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema_rs.validate(TOOL_SCHEMAS["add"], json.loads(call.function.arguments))
    follow = [
        *_ask("Add 2 and 3."),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=20)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _nested_one_of(width: int) -> dict:
    leaf = {"oneOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                       "required": [f"k{i}"]} for i in range(width)]}  # fmt: skip
    return {"oneOf": [{"type": "object", "properties": {f"n{i}": leaf}, "required": [f"n{i}"]}
                      for i in range(width)]}  # fmt: skip


def test_bad_constraints_get_400_in_bounded_time_while_a_stream_flows(server, client) -> None:
    chunks: list[float] = []
    done = threading.Event()

    def stream() -> None:
        s = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                      stream=True, extra_body={"ignore_eos": True})
        for _ in s:
            chunks.append(time.monotonic())
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    while not chunks:
        time.sleep(0.05)  # waiting for the stream's first chunk
    bad = [
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": _nested_one_of(200)}}},
        {"structured_outputs": {"regex": "[a-"}},
        {"guided_json": {"type": "no-such-type"}},
        {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
    ]  # fmt: skip
    for body in bad:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": _ask("hi"), **body})  # fmt: skip
        assert time.monotonic() - t0 < 10
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_grammar"
        assert err["param"] in body or err["param"] in ("response_format", "structured_outputs")
    during = len(chunks)
    t.join(300)
    assert done.is_set() and len(chunks) > during  # the stream kept flowing, and finished
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'vx:grammar_compile_failures_total\{cause="invalid"', text)
    assert re.search(r"vx:structured_requests_total\{[^}]*\} [1-9]", text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_unconstrained_request_beside_a_constrained_one_is_unaffected(
    client, temperature: float
) -> None:
    """Greedy constrained rows leave the greedy step's fast path to the others (only their own
    logits are formed); random ones put the step on the logits path. Either way the
    unconstrained request's greedy tokens are the ones it gets alone."""
    # As test_serve_smollm2: every greedy token of this answer leads by a wide margin.
    question = _ask("What is the capital of France? Answer in one sentence.")

    def plain() -> str:
        r = client.chat.completions.create(model=MODEL, messages=question, max_tokens=24,
                                           temperature=0)  # fmt: skip
        return r.choices[0].message.content

    alone = plain()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        constrained = [
            pool.submit(client.chat.completions.create, model=MODEL, n=2, max_tokens=200,
                        messages=_ask(f"A person as JSON, number {i}"), response_format=rf,
                        temperature=temperature)
            for i in range(2)
        ]  # fmt: skip
        time.sleep(0.5)  # let the constrained ones start decoding
        beside = plain()
        for f in constrained:
            for c in f.result().choices:
                jsonschema_rs.validate(PERSON_SCHEMA, json.loads(c.message.content))
    assert beside == alone


def test_a_grammar_that_takes_too_long_gets_400(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", **SERVED)
    # Any new grammar takes longer than a microsecond to compile.
    with VxServer(model, "--served-model-name", "tiny",
                  "--structured-outputs-timeout", "0.000001") as srv:  # fmt: skip
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}})  # fmt: skip
        assert time.monotonic() - t0 < 10
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "did not compile within" in err["message"] and err["param"] == "response_format"
        ok = httpx.post(srv.url + "/v1/completions", timeout=30,
                        json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert ok.status_code == 200
        assert 'vx:grammar_compile_failures_total{cause="timeout"' in httpx.get(
            srv.url + "/metrics").text  # fmt: skip


def test_llm_structured_outputs_on_the_tiny_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`vx.LLM` with constraints, n = 2, at TP = 1 and TP = 2 (the same texts: every rank's
    matchers mask alike); a grammar's end ends the request whatever min_tokens or ignore_eos
    say; a bad regex is a ValueError."""
    from vx import LLM, SamplingParams, StructuredOutputsParams

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llm"), arch="llama", **SERVED)
    texts_by_tp = []
    for tp in (1, 2):
        with LLM(model, num_threads=1, tensor_parallel_size=tp) as llm:
            so = StructuredOutputsParams(regex="[0-9]{4}-(ab|cd)")
            outs = llm.generate(["hello", "world"], SamplingParams(n=2, max_tokens=20, seed=5,
                                                                   structured_outputs=so),
                                use_tqdm=False)  # fmt: skip
            texts = [o.text for r in outs for o in r.outputs]
            assert len(texts) == 4 and all(re.fullmatch("[0-9]{4}-(ab|cd)", t) for t in texts)
            so = StructuredOutputsParams(json={"type": "object", "properties": {
                "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False})
            (out,) = llm.generate("hi", SamplingParams(temperature=0, max_tokens=40,
                                                       structured_outputs=so), use_tqdm=False)
            assert isinstance(json.loads(out.outputs[0].text)["ok"], bool)
            texts.append(out.outputs[0].text)
            texts_by_tp.append(texts)
            if tp == 2:
                continue
            # the grammar's end (8 tokens at most) comes before min_tokens and max_tokens
            so = StructuredOutputsParams(regex="[0-9]{2}")
            for extra in ({"min_tokens": 30}, {"ignore_eos": True}):
                (out,) = llm.generate("x", SamplingParams(max_tokens=40, structured_outputs=so,
                                                          **extra), use_tqdm=False)  # fmt: skip
                c = out.outputs[0]
                assert re.fullmatch("[0-9]{2}", c.text) and c.finish_reason == "stop", extra
                assert len(c.token_ids) <= 3, extra
            with pytest.raises(ValueError, match="regex"):
                llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
                    regex="[a-")), use_tqdm=False)  # fmt: skip
    assert texts_by_tp[0] == texts_by_tp[1]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_and_follow_their_schema(client, stream: bool) -> None:
    """Under auto the model writes freely; once it opens `<tool_call>` the structural tag holds
    the call to a tool's schema, and the hermes parser returns it as `tool_calls`."""
    messages: list[dict] = []
    for city in ("Rome", "Oslo", "Lima"):  # a few shots, rendered by the template's tool form
        call = {"id": f"call_{city}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "c"})}}
        messages += [*_ask(f"Weather in {city}?"),
                     {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    messages += _ask("Weather in Paris?")
    num_calls = 0
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, n=8,
                                           max_tokens=80, seed=seed, stream=stream)  # fmt: skip
        calls: dict[tuple[int, int], dict[str, str]] = {}
        reasons: dict[int, str | None] = {}
        if stream:
            for chunk in r:
                for c in chunk.choices:
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
                    for tc in c.delta.tool_calls or []:
                        call = calls.setdefault((c.index, tc.index), {"name": "", "args": ""})
                        call["name"] += tc.function.name or ""
                        call["args"] += tc.function.arguments or ""
        else:
            for c in r.choices:
                reasons[c.index] = c.finish_reason
                for j, tc in enumerate(c.message.tool_calls or []):
                    calls[(c.index, j)] = {"name": tc.function.name, "args": tc.function.arguments}
        for (index, _), call in calls.items():
            jsonschema_rs.validate(TOOL_SCHEMAS[call["name"]], json.loads(call["args"]))
            assert reasons[index] in ("tool_calls", "length")
        num_calls += len(calls)
        if num_calls:
            break
    assert num_calls, "no choice called a tool in 32 tries"


def test_constrained_requests_stay_valid_through_preemption(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A KV pool too small for the crowd preempts requests mid-output; each resumes with a
    matcher that replayed its tokens, so every output still matches (tiny random model)."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-preempt"), arch="llama", **SERVED)
    pattern = "[a-z]{2,6}( [a-z]{2,6}){20,30}\\."
    with VxServer(model, "--served-model-name", "tiny", "--num-gpu-blocks-override", "24",
                  "--max-model-len", "256") as srv:  # fmt: skip
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

        def one(i: int) -> list[str]:
            r = c.completions.create(model="tiny", prompt=f"story {i} " * 8, n=2, max_tokens=200,
                                     extra_body={"guided_regex": pattern})  # fmt: skip
            return [ch.text for ch in r.choices if ch.finish_reason == "stop"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = [t for ts in pool.map(one, range(8)) for t in ts]
        metrics = httpx.get(srv.url + "/metrics").text
    preempted = re.search(r'vx:num_preemptions_total\{[^}]*\} ([0-9.]+)', metrics)
    assert preempted and float(preempted.group(1)) > 0, "the pool was meant to preempt"
    assert len(texts) >= 8
    assert all(re.fullmatch(pattern, t) for t in texts), texts
