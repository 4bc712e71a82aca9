"""Tool calls: `tool_choice` as a grammar, and the model's text as OpenAI `tool_calls`.

Runs in: the ApiServer process.

- `required` and a named function are enforced by the grammar (`tool_constraint`): the model
  can only write a JSON array of {"name", "arguments"} objects (required), or the named
  function's arguments (named), each matching the function's parameter schema.
- `auto` lets the model write; a parser (`PARSERS`, `--tool-call-parser`) finds its calls.
  `hermes` reads Qwen2.5/Qwen3-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, the form vx's shipped ChatML tool template asks for.

Each parser is a `ToolCallParser`: `feed(text)` with however much text a step delivered, then
`finish()`. Both return `ToolDelta`s in order. Invariant: the concatenation of every delta's
`content` is the text outside tool calls, and the concatenation of one call's `arguments`
fragments is that call's whole arguments JSON, however the text was split into deltas (a
parser holds back what might be the start of a marker rather than guess).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from vx.http.errors import APIError

__all__ = [
    "PARSERS",
    "ToolCallParser",
    "ToolDelta",
    "parser_for",
    "tool_constraint",
    "tool_mode",
]


@dataclass
class ToolDelta:
    """Either content text, or (part of) tool call `index`: its id and name come once, with the
    first fragment of its arguments; later deltas of the same call carry arguments only."""

    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    @property
    def is_call(self) -> bool:
        return self.index >= 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_functions(tools: list[Any] | None) -> dict[str, dict[str, Any]]:
    """{name: function} of the request's tools; a 400 for a malformed tool."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, "each tool needs a function with a name", param=f"tools[{i}]")
        if tool.get("type", "function") != "function":
            raise APIError(400, "only tools of type function are supported",
                           param=f"tools[{i}].type")  # fmt: skip
        functions[fn["name"]] = fn
    return functions


def tool_mode(tools: list[Any] | None, tool_choice: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function's name)."""
    functions = _tool_functions(tools)
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice {tool_choice!r} is not none, auto, required or "
                           "a named function", param="tool_choice")  # fmt: skip
        if tool_choice != "none" and not functions:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", param="tool_choice")  # fmt: skip
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice")  # fmt: skip
    return "named", name


def tool_constraint(
    tools: list[Any] | None,
    mode: str,
    name: str | None,
    parallel: bool = True,
    auto_parser: str = "hermes",
) -> dict[str, Any] | None:
    """The `StructuredOutputsParams` fields enforcing `mode`: None for none; for auto, the
    parser's structural tag (free text, but a call's body follows its function's schema once
    its start marker appears), or None where the parser has none."""
    functions = _tool_functions(tools)
    if mode == "auto":
        tag = PARSERS[auto_parser].structural_tag(functions)
        return {"structural_tag": json.dumps(tag)} if tag is not None else None
    if mode == "named":
        assert name is not None
        return {"json": _parameters(functions[name])}
    if mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": fname}, "arguments": _parameters(fn)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fname, fn in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {"json": schema}


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


class ToolCallParser:
    """Base: turns the model's text, fed in pieces, into `ToolDelta`s (see the module)."""

    def __init__(self) -> None:
        self.num_calls = 0

    @classmethod
    def structural_tag(cls, functions: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        """vLLM's structural tag enforcing this format's calls under tool_choice auto."""
        return None

    def feed(self, text: str) -> list[ToolDelta]:
        raise NotImplementedError

    def finish(self) -> list[ToolDelta]:
        return []

    def _call(self, name: str, arguments: str) -> ToolDelta:
        self.num_calls += 1
        return ToolDelta(index=self.num_calls - 1, id=new_call_id(), name=name,
                         arguments=arguments)  # fmt: skip


class NamedParser(ToolCallParser):
    """tool_choice names one function: the whole text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[ToolDelta]:
        if self.num_calls == 0:
            return [self._call(self.name, text)]
        return [ToolDelta(index=0, arguments=text)] if text else []

    def finish(self) -> list[ToolDelta]:
        return [] if self.num_calls else [self._call(self.name, "")]


class _JsonCallsParser(ToolCallParser):
    """Calls as JSON objects ({"name", ARGS_KEY}) after an opening marker, in an array or
    separated by `;`. Each call goes out as soon as its object is complete, so a text cut by
    max_tokens still gives every call it finished. Text before the marker is content."""

    _DECODER = json.JSONDecoder()
    #: What opens the calls ("" for text that is calls from its start).
    MARKER = ""
    ARGS_KEY = "arguments"
    _SKIP = " \t\n\r,;["

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._pos = 0  # where the next object (or separator) starts
        self._in_calls = not self.MARKER

    def feed(self, text: str) -> list[ToolDelta]:
        self._text += text
        out: list[ToolDelta] = []
        if not self._in_calls:
            out += self._content()
            if not self._in_calls:
                return out
        while True:
            rest = self._text[self._pos :]
            stripped = rest.lstrip(self._SKIP)
            if not stripped.startswith("{"):
                return out
            start = self._pos + len(rest) - len(stripped)
            try:
                call, end = self._DECODER.raw_decode(self._text, start)
            except json.JSONDecodeError:
                return out  # the object is not complete yet
            self._pos = end
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                args = call.get(self.ARGS_KEY, {})
                out.append(self._call(call["name"], args if isinstance(args, str)
                                      else json.dumps(args)))  # fmt: skip

    def _content(self) -> list[ToolDelta]:
        """Content up to the marker (a tail that could begin it is held back)."""
        at = self._text.find(self.MARKER, self._pos)
        if at < 0:
            keep = _partial_suffix(self._text, self.MARKER)
            content = self._text[self._pos : len(self._text) - keep]
            self._pos += len(content)
            return [ToolDelta(content=content)] if content else []
        content = self._text[self._pos : at]
        self._pos, self._in_calls = at + len(self.MARKER), True
        return [ToolDelta(content=content)] if content else []

    def finish(self) -> list[ToolDelta]:
        if self._in_calls:
            return []
        rest = self._text[self._pos :]
        self._pos = len(self._text)
        return [ToolDelta(content=rest)] if rest else []


class RequiredParser(_JsonCallsParser):
    """tool_choice required: the text is a JSON array of {"name", "arguments"} (the grammar
    guarantees its form)."""


class MistralParser(_JsonCallsParser):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after free text.

    NOTE: `[TOOL_CALLS]` is a special token in Mistral's tokenizers; the client must send
    `skip_special_tokens: false` for it to reach the text (as with vLLM)."""

    MARKER = "[TOOL_CALLS]"

    @classmethod
    def structural_tag(cls, functions: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        structures = [
            {"begin": f'{cls.MARKER}[{{"name": {json.dumps(name)}, "arguments": ',
             "schema": _parameters(fn), "end": "}]"}
            for name, fn in functions.items()
        ]  # fmt: skip
        return {"structures": structures, "triggers": [cls.MARKER]}


class Llama3JsonParser(_JsonCallsParser):
    """Llama 3.1/3.2's JSON calls: `{"name": ..., "parameters": {...}}`, several joined by `;`,
    optionally after `<|python_tag|>`. A text that opens with anything else is content."""

    ARGS_KEY = "parameters"
    PYTHON_TAG = "<|python_tag|>"
    MARKER = "{"  # stands for the decision below; never searched for

    def __init__(self) -> None:
        super().__init__()
        self._plain = False  # decided: the text is no call

    def _content(self) -> list[ToolDelta]:
        if self._plain:
            content, self._pos = self._text[self._pos :], len(self._text)
            return [ToolDelta(content=content)] if content else []
        stripped = self._text.lstrip()
        if stripped.startswith(self.PYTHON_TAG) or stripped.startswith("{"):
            self._in_calls = True
            self._pos = len(self._text) - len(stripped)
            if stripped.startswith(self.PYTHON_TAG):
                self._pos += len(self.PYTHON_TAG)
            return []
        if not stripped or self.PYTHON_TAG.startswith(stripped):
            return []  # not decided yet
        self._plain = True  # all of it is content, now and later
        return self._content()

    @classmethod
    def structural_tag(cls, functions: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        structures = [
            {"begin": f'{{"name": {json.dumps(name)}, "parameters": ', "schema": _parameters(fn),
             "end": "}"}
            for name, fn in functions.items()
        ]  # fmt: skip
        return {"structures": structures, "triggers": ['{"name": ']}


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks within free text.

    A call's arguments stream as they arrive once its header (`{"name": "...", "arguments": `)
    is complete: every fragment sent is a prefix of the final arguments, because the text from
    the last `}` seen (and the blanks before it) is held back until the end tag shows which
    `}` closes the call. Arguments are the model's own JSON text, streamed or not.
    """

    START = "<tool_call>"
    END = "</tool_call>"
    _HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')

    @classmethod
    def structural_tag(cls, functions: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        # The form vx's chatml_tools template (and Qwen's) shows the model.
        structures = [
            {"begin": f'{cls.START}\n{{"name": {json.dumps(name)}, "arguments": ',
             "schema": _parameters(fn), "end": f"}}\n{cls.END}"}
            for name, fn in functions.items()
        ]  # fmt: skip
        return {"structures": structures, "triggers": [cls.START]}

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._in_call = False
        #: Of the call being streamed: where its arguments start in `_buffer`, and how much
        #: of them went out (None: its header is not complete yet).
        self._args_start: int | None = None
        self._sent = 0

    def feed(self, text: str) -> list[ToolDelta]:
        self._buffer += text
        out: list[ToolDelta] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(self.START)
                if at < 0:
                    # Hold back a tail that could begin the marker.
                    keep = _partial_suffix(self._buffer, self.START)
                    content = self._buffer[: len(self._buffer) - keep]
                    if content:
                        out.append(ToolDelta(content=content))
                    self._buffer = self._buffer[len(content) :]
                    return out
                if at:
                    out.append(ToolDelta(content=self._buffer[:at]))
                self._buffer = self._buffer[at + len(self.START) :]
                self._in_call = True
            at = self._buffer.find(self.END)
            if at < 0:
                out.extend(self._stream_arguments())
                return out
            out.extend(self._end_call(self._buffer[:at]))
            self._buffer = self._buffer[at + len(self.END) :]

    def _stream_arguments(self) -> list[ToolDelta]:
        """The next fragment of the open call's arguments (its header first), if any is sure."""
        out: list[ToolDelta] = []
        if self._args_start is None:
            header = self._HEADER.match(self._buffer)
            if header is None:
                return out
            self._args_start, self._sent = header.end(), 0
            out.append(self._call(json.loads(f'"{header.group(1)}"'), ""))
        # Up to the last `}` (it may close the call), less the blanks before it (they would
        # not be part of the arguments if it does).
        brace = self._buffer.rfind("}", self._args_start)
        sure = self._buffer[self._args_start : brace if brace >= 0 else None].rstrip()
        if len(sure) > self._sent:
            out.append(ToolDelta(index=self.num_calls - 1, arguments=sure[self._sent :]))
            self._sent = len(sure)
        return out

    def _end_call(self, body: str) -> list[ToolDelta]:
        """The rest of the call whose body is `body` (its end tag seen, or EOS)."""
        streamed, self._args_start = self._args_start, None
        self._in_call = False
        if streamed is not None:
            final = body[streamed : body.rfind("}")].rstrip()
            rest = final[self._sent :]
            return [ToolDelta(index=self.num_calls - 1, arguments=rest)] if rest else []
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            # Not a call after all: the text goes back to the client as content.
            return [ToolDelta(content=f"{self.START}{body}{self.END}")]
        args = call.get("arguments", call.get("parameters", {}))
        return [self._call(call["name"], args if isinstance(args, str) else json.dumps(args))]

    def finish(self) -> list[ToolDelta]:
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return [ToolDelta(content=rest)] if rest else []
        if self._args_start is not None:  # ended (EOS) before its end tag
            return self._end_call(rest)
        out = self._end_call(rest.strip())
        if out and not out[0].is_call:
            out = [ToolDelta(content=self.START + rest)]
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parser_for(mode: str, name: str | None, auto_parser: str) -> ToolCallParser | None:
    """The parser of one choice's text under `mode` (None: the text is plain content)."""
    if mode == "named":
        assert name is not None
        return NamedParser(name)
    if mode == "required":
        return RequiredParser()
    if mode == "auto":
        return PARSERS[auto_parser]()
    return None
