"""The tool-call and reasoning parsers fed the model's text in pieces of every size.

A step may deliver one token or many (async scheduling, a slow reader, a stop string held
back), so each parser must give the same content and the same whole arguments whatever the
split: the property vLLM #55082 and #48347 broke.
"""

from __future__ import annotations

import json

import pytest

from vx.http.errors import APIError
from vx.http.reasoning import PARSERS as REASONING
from vx.http.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCallParser,
    tool_constraint,
    tool_mode,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]  # fmt: skip

HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <3"}}\n'
    '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> done <'
)


def _splits(text: str) -> list[list[str]]:
    """The text whole, char by char, and in pieces of 2, 3, 5, 7 and 13 characters."""
    out = [[text], list(text)]
    for n in (2, 3, 5, 7, 13):
        out.append([text[i : i + n] for i in range(0, len(text), n)])
    return out


def _run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    content = "".join(d.content for d in deltas if not d.is_call)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        if d.is_call:
            call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": ""})
            if d.id is not None:
                assert not call["id"], "a call's id and name come once"
                call["id"], call["name"] = d.id, d.name or ""
            call["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("pieces", _splits(HERMES_TEXT), ids=lambda p: f"{len(p)}pieces")
def test_hermes_gives_the_same_calls_however_the_text_is_split(pieces: list[str]) -> None:
    content, calls = _run(HermesParser(), pieces)
    assert content == "Let me check. \n done <"
    assert [c["name"] for c in calls.values()] == ["get_weather", "add"]
    assert calls[0]["arguments"] == '{"city": "Paris <3"}'
    assert calls[1]["arguments"] == '{"a": 1, "b": 2}'
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_hermes_call_cut_by_eos_before_its_end_tag_still_counts() -> None:
    content, calls = _run(HermesParser(), ['<tool_call>{"name": "add", "arguments": {"a": 1}}'])
    assert content == "" and calls[0]["name"] == "add"


def test_hermes_block_that_is_not_a_call_stays_content() -> None:
    text = "a <tool_call>not json</tool_call> b"
    for pieces in _splits(text):
        content, calls = _run(HermesParser(), pieces)
        assert (content, calls) == (text, {})


@pytest.mark.parametrize("pieces", _splits('{"a": 1, "b": 22}'), ids=lambda p: f"{len(p)}pieces")
def test_named_streams_the_arguments_without_losing_any(pieces: list[str]) -> None:
    content, calls = _run(NamedParser("add"), pieces)
    assert content == "" and calls[0]["name"] == "add"
    assert calls[0]["arguments"] == '{"a": 1, "b": 22}'


def test_required_gives_each_call_of_the_array() -> None:
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    for pieces in _splits(text):
        content, calls = _run(RequiredParser(), pieces)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("add", {"a": 1}), ("get_weather", {})]  # fmt: skip


def test_tool_choice_modes_and_their_grammar() -> None:
    assert tool_mode(TOOLS, None) == ("auto", None)
    assert tool_mode(None, None) == ("none", None)
    assert tool_mode(TOOLS, "required") == ("required", None)
    named = {"type": "function", "function": {"name": "add"}}
    assert tool_mode(TOOLS, named) == ("named", "add")
    assert tool_constraint(TOOLS, "named", "add") == {"json": TOOLS[1]["function"]["parameters"]}
    required = tool_constraint(TOOLS, "required", None)["json"]
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert tool_constraint(TOOLS, "none", None) is None
    assert "structural_tag" in tool_constraint(TOOLS, "auto", None)
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(APIError) as e:
            tool_mode(TOOLS, bad)
        assert e.value.status == 400 and e.value.param == "tool_choice"


REASONED = "<think>\nThe user wants 2+2. </thin no, </think>\n\nIt is 4. <think> stays"


@pytest.mark.parametrize("pieces", _splits(REASONED), ids=lambda p: f"{len(p)}pieces")
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_split_is_the_same_however_the_text_is_split(
    name: str, pieces: list[str]
) -> None:
    parser = REASONING[name]()
    parts = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(r for r, _ in parts)
    content = "".join(c for _, c in parts)
    assert reasoning == "\nThe user wants 2+2. </thin no, "
    assert content == "\n\nIt is 4. <think> stays"


def test_reasoning_parsers_differ_without_an_opening_tag() -> None:
    r1, qwen = REASONING["deepseek_r1"](), REASONING["qwen3"]()
    text = "thinking...</think>answer"
    assert [a + b for a, b in zip(r1.feed(text), r1.finish(), strict=True)] == [
        "thinking...", "answer"]  # fmt: skip
    assert [a + b for a, b in zip(qwen.feed(text), qwen.finish(), strict=True)] == [
        "", text]  # fmt: skip


def test_required_cut_by_max_tokens_keeps_the_calls_it_finished() -> None:
    text = '[{"name": "add", "arguments": {"a": 1}},\n{"name": "add", "argu'
    for pieces in _splits(text):
        content, calls = _run(RequiredParser(), pieces)
        assert content == "" and len(calls) == 1 and calls[0]["arguments"] == '{"a": 1}'


def test_auto_enforces_the_call_grammar_after_the_marker() -> None:
    """Under auto, hermes' structural tag lets text through and forces a call's body to its
    function's schema once `<tool_call>` appears (checked with llguidance's matcher)."""
    import llguidance

    from vx.grammar import grammar_of
    from vx.sampling_params import StructuredOutputsParams

    so = tool_constraint(TOOLS, "auto", None)
    grammar = grammar_of(StructuredOutputsParams(**so))
    ok = ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> '
          "and more text")  # fmt: skip
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": "one"}}\n</tool_call>'
    from tests.models import _tokenizer_json

    tok = llguidance.LLTokenizer(_tokenizer_json(384))

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        ids = tok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and not m.is_error()

    assert accepts(ok)
    assert not accepts(bad)


def test_hermes_streams_arguments_before_the_end_tag() -> None:
    parser = HermesParser()
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": {"c": "}"}} }\n</tool_call>'
    at = text.index("</tool_call>")
    early = [d for ch in text[:at] for d in parser.feed(ch)]
    assert early[0].name == "add" and early[0].id
    sent = "".join(d.arguments for d in early)
    assert len([d for d in early if d.arguments]) > 5 and sent.startswith('{"a": 12, "b": {"c": "')
    late = parser.feed(text[at:]) + parser.finish()
    assert sent + "".join(d.arguments for d in late) == '{"a": 12, "b": {"c": "}"}}'


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (MistralParser, 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
                        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Sure."),
        (Llama3JsonParser, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
                           '{"name": "get_weather", "parameters": {"city": "Oslo"}}', ""),
        (Llama3JsonParser, ' {"name": "add", "parameters": {"a": 1}};{"name": "get_weather", '
                           '"parameters": {"city": "Oslo"}}', ""),
    ],
)  # fmt: skip
def test_mistral_and_llama3_json_calls_however_split(parser, text: str, content: str) -> None:
    for pieces in _splits(text):
        got, calls = _run(parser(), pieces)
        assert got == content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]  # fmt: skip


def test_llama3_json_plain_text_is_content() -> None:
    for pieces in _splits("The answer is {not a call} 42."):
        assert _run(Llama3JsonParser(), pieces) == ("The answer is {not a call} 42.", {})


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json"])
def test_each_parsers_structural_tag_compiles(parser: str) -> None:
    from vx.grammar import grammar_of
    from vx.sampling_params import StructuredOutputsParams

    so = tool_constraint(TOOLS, "auto", None, auto_parser=parser)
    assert grammar_of(StructuredOutputsParams(**so))
