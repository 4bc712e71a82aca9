"""Tool calls and reasoning through the real front (vx.http app, rings, detokenizer, SSE):
the fake engine replies with a scripted text one token a step, so the OpenAI shapes of
`message.tool_calls`, `delta.tool_calls`, `reasoning_content` and the finish reasons can be
checked exactly, streamed and not, and the constraint the front sends is checked too."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.http.conftest import running_app
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
CALLS = ('Hi <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
         '<tool_call>{"name": "add", "arguments": {"a": 22}}</tool_call>')  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200}


def _sse(text: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_auto_tool_calls_whole_and_streamed(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, reply=CALLS) as h, h.http() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] == "Hi "
        assert [(t["type"], t["function"]["name"], t["function"]["arguments"])
                for t in msg["tool_calls"]] == [("function", "add", '{"a": 1}'),
                                                ("function", "add", '{"a": 22}')]  # fmt: skip
        assert all(t["id"].startswith("call_") for t in msg["tool_calls"])
        # auto sends hermes' structural tag, so a call's body is held to its schema
        so = h.engine.adds()[0].sampling_params.structured_outputs
        assert so is not None and "<tool_call>" in so.structural_tag

        r = await c.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS, "stream": True})
        chunks = _sse(r.text)
        content, calls, reasons = "", {}, []
        for ch in chunks:
            for choice in ch["choices"]:
                content += choice["delta"].get("content") or ""
                reasons.append(choice["finish_reason"])
                for tc in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(tc["index"], {"name": "", "args": "", "ids": 0})
                    call["ids"] += "id" in tc
                    call["name"] += tc["function"].get("name") or ""
                    call["args"] += tc["function"].get("arguments") or ""
        assert content == "Hi "
        assert calls == {0: {"name": "add", "args": '{"a": 1}', "ids": 1},
                         1: {"name": "add", "args": '{"a": 22}', "ids": 1}}  # fmt: skip
        assert [x for x in reasons if x] == ["tool_calls"]


async def test_required_and_named_send_their_grammar(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, reply='[{"name": "add", "arguments": {"a": 3}}]') as h, \
            h.http() as c:  # fmt: skip
        r = await c.post("/v1/chat/completions",
                         json={**CHAT, "tools": TOOLS, "tool_choice": "required"})
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] is None
        assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 3}'}
        schema = json.loads(json.dumps(h.engine.adds()[0].sampling_params.structured_outputs.json))
        assert schema["type"] == "array" and schema["minItems"] == 1
        named = {"type": "function", "function": {"name": "add"}}
        r = await c.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS,
                                                       "tool_choice": named, "stream": True})
        args = "".join(tc["function"].get("arguments") or ""
                       for ch in _sse(r.text) for choice in ch["choices"]
                       for tc in choice["delta"].get("tool_calls") or [])  # fmt: skip
        assert args == '[{"name": "add", "arguments": {"a": 3}}]'  # the named call's text
        assert h.engine.adds()[-1].sampling_params.structured_outputs.json == TOOLS[0][
            "function"]["parameters"]  # fmt: skip


REASONED = "<think>Let me see. 2+2</think>It is 4."


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_reasoning_content_whole_and_streamed(tokenizer: Tokenizer, parser: str) -> None:
    async with running_app(tokenizer, reply=REASONED, reasoning_parser=parser) as h, \
            h.http() as c:  # fmt: skip
        r = await c.post("/v1/chat/completions", json=CHAT)
        msg = r.json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("Let me see. 2+2", "It is 4.")
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        deltas = [choice["delta"] for ch in _sse(r.text) for choice in ch["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see. 2+2"
        assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
        # a constraint holds only after the reasoning
        await c.post("/v1/chat/completions", json={**CHAT, "guided_regex": "[0-9]"})
        so = h.engine.adds()[-1].sampling_params.structured_outputs
        assert so.regex == "[0-9]" and so.reasoning_parser == parser
