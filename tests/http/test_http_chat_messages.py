"""Chat messages are checked as OpenAI checks them: every refusal is a 400 envelope whose `param`
is the field's path, and nothing reaches the engine; every valid shape is rendered and served.

Both /v1/chat/completions and /tokenize (chat style) take messages, so both are driven.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.conftest import running_app
from tests.http.test_http_errors import assert_envelope
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

#: (messages, the `param` the 400 names, a word its message must contain)
BAD_MESSAGES: list[tuple[list[Any], str, str]] = [
    # roles
    ([{"role": "wizard", "content": "x"}], "messages[0].role", "wizard"),
    ([USER, {"role": "function", "content": "x"}], "messages[1].role", "function"),
    ([{"role": "", "content": "x"}], "messages[0].role", "Supported"),
    ([{"role": 1, "content": "x"}], "messages[0].role", "str"),
    ([{"role": None, "content": "x"}], "messages[0].role", "str"),
    ([{"content": "x"}], "messages[0].role", "role"),
    ([5], "messages[0]", "object"),
    # content of the wrong type, or null where OpenAI does not allow it
    ([{"role": "user", "content": 5}], "messages[0].content", "int"),
    ([{"role": "user", "content": {"type": "text", "text": "x"}}], "messages[0].content", "object"),
    ([{"role": "user"}], "messages[0].content", "null"),
    ([{"role": "user", "content": None}], "messages[0].content", "null"),
    ([{"role": "system", "content": None}], "messages[0].content", "null"),
    ([{"role": "developer"}], "messages[0].content", "null"),
    ([USER, {"role": "assistant", "content": None}], "messages[1].content", "null"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}], "messages[1].content", "null"),
    ([{"role": "user", "content": []}], "messages[0].content", "empty"),
    # content parts
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]", "object"),
    ([{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0].type", "type"),
    ([{"role": "user", "content": [{"type": 3, "text": "hi"}]}], "messages[0].content[0].type", "string"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text", "text"),
    ([{"role": "user", "content": [{"type": "video", "video": "x"}]}], "messages[0].content[0].type", "video"),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], "messages[0].content[0].type", "refusal"),
    ([{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]}], "messages[0].content[1].type", "no image input"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "messages[0].content[0].type", "no image input"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}], "messages[0].content[0].type", "no audio input"),
    ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}], "messages[0].content[0].type", "no file input"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0].type", "no image input"),
    ([USER, {"role": "assistant", "content": [{"type": "refusal"}]}], "messages[1].content[0].refusal", "refusal"),
    # name, tool_call_id, tool_calls
    ([{"role": "user", "content": "x", "name": 5}], "messages[0].name", "str"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id", "tool_call_id"),
    ([{"role": "tool", "content": "42", "tool_call_id": 7}], "messages[0].tool_call_id", "str"),
    ([{"role": "tool", "tool_call_id": "call_1"}], "messages[0].content", "null"),
    ([USER, {"role": "assistant", "tool_calls": CALL}], "messages[1].tool_calls", "array"),
    ([USER, {"role": "assistant", "tool_calls": ["f"]}], "messages[1].tool_calls[0]", "object"),
    ([USER, {"role": "assistant", "tool_calls": [CALL, {"type": "function"}]}], "messages[1].tool_calls[1].function", "function"),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}], "messages[1].tool_calls[0].type", "custom"),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "id": 1}]}], "messages[1].tool_calls[0].id", "string"),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f"}}]}], "messages[1].tool_calls[0].function.arguments", "string"),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}], "messages[1].tool_calls[0].function.name", "string"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls", "assistant"),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_bad_messages_are_400_naming_the_field(tokenizer: Tokenizer, path: str) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        for messages, param, word in BAD_MESSAGES:
            r = await c.post(path, json={"messages": messages})
            err = assert_envelope(r, 400, param=param)
            assert err["type"] == "invalid_request_error", err
            assert word.lower() in err["message"].lower(), (messages, err)
        assert not h.engine.adds()


async def test_media_parts_say_the_server_is_text_only(tokenizer: Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "stream": True}  # fmt: skip
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post("/v1/chat/completions", json=body)
        err = assert_envelope(r, 400, param="messages[0].content[0].type", code="invalid_value")
        assert "image_url" in err["message"] and "text only" in err["message"]
        assert not h.engine.adds()


#: (messages, the messages the chat template must see)
GOOD_MESSAGES: list[tuple[list[Any], list[dict[str, Any]]]] = [
    ([USER], [USER]),
    ([{"role": "system", "content": "Be brief."}, USER],
     [{"role": "system", "content": "Be brief."}, USER]),
    ([{"role": "developer", "content": "Be brief."}, USER],
     [{"role": "developer", "content": "Be brief."}, USER]),
    ([{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
     [{"role": "user", "content": "one\ntwo"}]),
    ([{"role": "system", "content": [{"type": "text", "text": "sys"}]}, USER],
     [{"role": "system", "content": "sys"}, USER]),
    ([{"role": "user", "content": "", "name": "ann"}], [{"role": "user", "content": ""}]),
    ([USER, {"role": "assistant", "content": "hello"}, USER],
     [USER, {"role": "assistant", "content": "hello"}, USER]),
    ([USER, {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]}, USER],
     [USER, {"role": "assistant", "content": "a\nb"}, USER]),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "42", "tool_call_id": "call_1"}],
     [USER, {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "call_1"}],
     [USER, {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]),
    ([{"role": "user", "content": "x", "unknown_field": 1}], [{"role": "user", "content": "x"}]),
]  # fmt: skip


async def test_valid_messages_are_served(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        for i, (messages, seen) in enumerate(GOOD_MESSAGES):
            r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            assert r.status_code == 200, (messages, r.text)
            text = tokenizer.apply_chat_template(seen)
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert h.engine.adds()[i].prompt_token_ids == ids, messages
            r = await c.post("/tokenize", json={"messages": messages})
            assert r.status_code == 200 and r.json()["tokens"] == ids, (messages, r.text)
        assert h.metrics.totals()["rejected"] == 0


#: Gemma 2's chat template in short: no system role (it raises on one), turns as Gemma's.
GEMMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content']"
    " + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_system_message_folds_into_the_first_user_turn(tokenizer: Tokenizer) -> None:
    """A template with no system role: the system text goes before the first user turn's, as
    Gemma 3's template folds it itself; a template that has one renders it unchanged."""
    from vx.http.chat import render_chat

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render_chat(tokenizer, msgs, add_generation_prompt=True, chat_template=GEMMA2_TEMPLATE)
    assert text == "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    plain = render_chat(tokenizer, msgs, add_generation_prompt=True)
    assert "Be brief." in plain and "\n\nhi" not in plain


def test_enable_thinking_reaches_the_template(tokenizer: Tokenizer) -> None:
    """Qwen3's `enable_thinking` goes through `chat_template_kwargs` to the template."""
    from vx.http.chat import render_chat

    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    off = render_chat(
        tokenizer, msgs, add_generation_prompt=True, chat_template=template,
        extra={"enable_thinking": False},
    )  # fmt: skip
    assert off == "hi<think>\n\n</think>"
    assert render_chat(tokenizer, msgs, add_generation_prompt=True, chat_template=template) == "hi"
