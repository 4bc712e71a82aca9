"""POST /v1/chat/completions: the tokenizer's chat template, n, logprobs, streaming.

Runs in: the ApiServer process. Streams follow OpenAI's shape: one id for every chunk, the
role alone in each choice's first chunk, `finish_reason` only on a choice's last chunk, and with
`stream_options.include_usage` a final chunk with `choices: []` and the usage, before
`data: [DONE]`.

Tools: `tools` go to the chat template; `tool_choice` required or named is enforced by a
grammar, and auto is parsed (`vx.http.tool_calls`) into `message.tool_calls` (streamed as
`delta.tool_calls`), with `finish_reason: "tool_calls"` when the model called one. With
`--reasoning-parser`, `<think>...</think>` goes to `reasoning_content` (`vx.http.reasoning`).
Each choice has its own parsers, fed the text deltas in order: the reasoning parser first, then
the tool-call parser on what is content.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from vx.http.completions import check_length, serve_generation
from vx.http.detokenizer import TextState
from vx.http.errors import APIError
from vx.http.generation import Choice, Generation, ServerContext, new_request_id
from vx.http.protocol import (
    ROLES,
    ChatCompletionRequest,
    CompletionMessage,
    build_sampling_params,
    check_prompt_ids,
    check_stream_options,
    constraint_param,
    fan_out,
    structured_outputs_of,
)
from vx.http.reasoning import PARSERS as REASONING_PARSERS, ReasoningParser
from vx.http.tokenizer import ChatTemplateError, Tokenizer
from vx.http.tool_calls import ToolCallParser, ToolDelta, parser_for, tool_constraint, tool_mode

logger = logging.getLogger(__name__)


#: OpenAI's content part types for media; the model this server runs takes text only.
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "input_audio": "audio",
    "file": "file",
}


def message_dicts(messages: list[CompletionMessage]) -> list[dict[str, Any]]:
    """The messages as the dicts chat templates expect; text parts are joined with newlines.

    Checks what OpenAI checks, each failure a 400 whose `param` is the field's path
    (`messages[1].content[0].type`): the role is one of `ROLES`; content is a string or a
    non-empty list of text parts (assistant messages may also have refusal parts), and is null
    only on an assistant message with tool calls; media parts (image, audio, file) are refused,
    the model being text-only; `tool_calls` appear only on assistant messages, each with a
    `function` naming a string `name` and string `arguments`; a tool message has a
    `tool_call_id`. `name` and `tool_call_id` are strings (checked when decoding).
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    return [_message_dict(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message_dict(m: CompletionMessage, at: str) -> dict[str, Any]:
    """One checked message (see `message_dicts`); `at` is its path in the request."""
    if m.role not in ROLES:
        supported = ", ".join(repr(r) for r in ROLES)
        raise APIError(
            400, f"Invalid value: {m.role!r}. Supported values are: {supported}.",
            param=f"{at}.role", code="invalid_value",
        )  # fmt: skip
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise APIError(
                400, f"tool_calls is only allowed on assistant messages, not {m.role!r} ones",
                param=f"{at}.tool_calls", code="invalid_value",
            )  # fmt: skip
        for j, call in enumerate(m.tool_calls):
            _check_tool_call(call, f"{at}.tool_calls[{j}]")
    if m.role == "tool" and m.tool_call_id is None:
        raise APIError(
            400, f"Missing required parameter: '{at}.tool_call_id'.",
            param=f"{at}.tool_call_id", code="missing_required_parameter",
        )  # fmt: skip
    content = m.content
    if content is None:
        if m.role != "assistant" or not m.tool_calls:
            raise APIError(
                400, f"Invalid type for '{at}.content': expected a string or an array of "
                "content parts, got null (null is allowed only on an assistant message with "
                "tool_calls).",
                param=f"{at}.content", code="invalid_type",
            )  # fmt: skip
        content = ""
    elif isinstance(content, list):
        content = _join_text_parts(content, m.role, f"{at}.content")
    d: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls is not None:
        d["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def _join_text_parts(parts: list[dict[str, Any]], role: str, at: str) -> str:
    if not parts:
        raise APIError(
            400, f"Invalid '{at}': empty array. Expected a string or at least one content part.",
            param=at, code="empty_array",
        )  # fmt: skip
    # An assistant's refusal is text the model said, so it is rendered like text.
    allowed = ("text", "refusal") if role == "assistant" else ("text",)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        where = f"{at}[{j}]"
        if kind is None:
            raise APIError(
                400, f"Missing required parameter: '{where}.type'.", param=f"{where}.type",
                code="missing_required_parameter",
            )  # fmt: skip
        if not isinstance(kind, str):
            raise APIError(
                400, f"'{where}.type' must be a string", param=f"{where}.type",
                code="invalid_type",
            )  # fmt: skip
        if kind in _MEDIA_PARTS:
            raise APIError(
                400, f"Content parts of type {kind!r} are not supported: this server has no "
                f"{_MEDIA_PARTS[kind]} input (its model takes text only).",
                param=f"{where}.type", code="invalid_value",
            )  # fmt: skip
        if kind not in allowed:
            supported = " and ".join(repr(a) for a in allowed)
            raise APIError(
                400, f"Invalid value: {kind!r}. Supported values are: {supported}.",
                param=f"{where}.type", code="invalid_value",
            )  # fmt: skip
        text = part.get(kind)
        if not isinstance(text, str):
            raise APIError(
                400, f"a {kind} content part needs a string `{kind}`",
                param=f"{where}.{kind}", code="invalid_type",
            )  # fmt: skip
        texts.append(text)
    return "\n".join(texts)


def _check_tool_call(call: dict[str, Any], at: str) -> None:
    """What chat templates read of an assistant's tool call (OpenAI requires the same)."""
    if call.get("type", "function") != "function":
        raise APIError(
            400, f"Invalid value: {call['type']!r}. Supported values are: 'function'.",
            param=f"{at}.type", code="invalid_value",
        )  # fmt: skip
    if "id" in call and not isinstance(call["id"], str):
        raise APIError(400, f"{at}.id must be a string", param=f"{at}.id", code="invalid_type")
    function = call.get("function")
    if not isinstance(function, dict):
        raise APIError(
            400, "a tool call needs a `function` object with `name` and `arguments`",
            param=f"{at}.function", code="invalid_type",
        )  # fmt: skip
    for key in ("name", "arguments"):
        if not isinstance(function.get(key), str):
            raise APIError(
                400, f"{at}.function.{key} must be a string", param=f"{at}.function.{key}",
                code="invalid_type",
            )  # fmt: skip


def fold_system_role(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with a leading system (or developer) message's text put before the first
    user turn's, a blank line between, for templates with no system role (Gemma 2's raises on
    one; Gemma 3's does this fold itself). None where there is nothing to fold or a content is
    not plain text."""
    if not messages or messages[0].get("role") not in ("system", "developer"):
        return None
    system, rest = messages[0].get("content"), list(messages[1:])
    if not isinstance(system, str):
        return None
    for i, m in enumerate(rest):
        if m.get("role") == "user":
            if not isinstance(m.get("content"), str):
                return None
            rest[i] = {**m, "content": f"{system}\n\n{m['content']}"}
            return rest
    return [{"role": "user", "content": system}, *rest]


def render_chat(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: list[Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text; template failures are a 400."""
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400, "continue_final_message and add_generation_prompt are exclusive",
            param="continue_final_message",
        )  # fmt: skip
    kwargs = dict(extra or {})
    if tools is not None:
        kwargs["tools"] = tools
    try:
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **kwargs,
            )  # fmt: skip
        except ChatTemplateError as e:
            folded = fold_system_role(messages) if "system role" in str(e).lower() else None
            if folded is None:
                raise
            text = tok.apply_chat_template(
                folded, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **kwargs,
            )  # fmt: skip
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    if continue_final_message:
        final = str(messages[-1].get("content", "")).strip()
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    return text


class _TextSplit:
    """One choice's parsers and what they have produced (see the module docstring)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolDelta]]:
        """(reasoning, content, tool-call deltas) of the next `text`; `final` flushes."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.tools is None:
            return reasoning, content, []
        deltas = self.tools.feed(content) if content else []
        if final:
            deltas += self.tools.finish()
        text_out = "".join(d.content for d in deltas if not d.is_call)
        return reasoning, text_out, [d for d in deltas if d.is_call]

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0


def _merge_calls(deltas: list[ToolDelta]) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` entries, one per call index, fragments of one call joined."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        entry = calls.get(d.index)
        if entry is None:
            entry = calls[d.index] = {"index": d.index, "function": {"arguments": ""}}
            if d.id is not None:
                entry["id"] = d.id
                entry["type"] = "function"
                entry["function"] = {"name": d.name, "arguments": ""}
        entry["function"]["arguments"] += d.arguments
    return list(calls.values())


class ChatGeneration(Generation):
    object_name = "chat.completion.chunk"

    def __init__(
        self,
        *args: Any,
        logprobs: bool,
        top_logprobs: int,
        tool_mode: tuple[str, str | None] = ("none", None),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.tool_mode = tool_mode
        self._splits: dict[int, _TextSplit] = {}

    def _new_split(self) -> _TextSplit:
        name = self.ctx.reasoning_parser
        reasoning = REASONING_PARSERS[name]() if name else None
        mode, fn = self.tool_mode
        return _TextSplit(reasoning, parser_for(mode, fn, self.ctx.tool_call_parser))

    def _split_of(self, c: Choice) -> _TextSplit:
        split = self._splits.get(c.index)
        if split is None:
            split = self._splits[c.index] = self._new_split()
        return split

    @property
    def _plain(self) -> bool:
        """No parser touches the text (the common case pays for nothing)."""
        return self.ctx.reasoning_parser is None and self.tool_mode[0] == "none"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.ctx.tokenizer.token_bytes(token_id)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": logprob,
            "bytes": list(raw),
        }

    def _logprobs(self, rows: tuple[list[list[int]], list[list[float]]]) -> dict[str, Any]:
        content = []
        for ids, values in zip(*rows, strict=True):
            entry = self._entry(ids[0], values[0])
            k = self.top_logprobs
            entry["top_logprobs"] = [
                self._entry(t, v) for t, v in zip(ids[1 : 1 + k], values[1 : 1 + k], strict=True)
            ]
            content.append(entry)
        return {"content": content}

    def first_chunks(self, c: Choice) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [
            self.chunk(
                [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]
            )
        ]

    def delta_chunk(self, c: Choice, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        logprobs = None
        if self.logprobs:
            rows = self.take_logprob_rows(c)
            if rows[0]:
                logprobs = self._logprobs(rows)
        delta: dict[str, Any] = {}
        if self._plain:
            if text:
                delta["content"] = text
        else:
            split = self._split_of(c)
            reasoning, text, calls = split.feed(text, final=finish_reason is not None)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = _merge_calls(calls)
            if finish_reason == "stop" and split.num_calls:
                finish_reason = "tool_calls"
        if not (delta or logprobs or finish_reason):
            return None
        choice = {
            "index": c.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason:
            choice["stop_reason"] = c.state.stop_reason
        return self.chunk([choice])

    def final_body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            logprobs = self._logprobs((c.lp_token_ids, c.lp_values)) if self.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": c.state.text}
            finish_reason = c.state.finish_reason
            if not self._plain:
                split = self._new_split()
                reasoning, text, calls = split.feed(c.state.text, final=True)
                if self.ctx.reasoning_parser is not None:
                    message["reasoning_content"] = reasoning or None
                message["content"] = text if text or not calls else None
                if calls:
                    message["tool_calls"] = [
                        {k: v for k, v in call.items() if k != "index"}
                        for call in _merge_calls(calls)
                    ]
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": c.state.stop_reason,
                }
            )
        body = self.chunk(choices)
        body["object"] = "chat.completion"
        body["usage"] = self.usage()
        return body


async def build_chat(ctx: ServerContext, req: ChatCompletionRequest) -> ChatGeneration:
    """Validate, render and tokenize; every failure here is an APIError, nothing admitted."""
    model = ctx.check_model(req.model)
    ctx.check_available()
    mode = tool_mode(req.tools, req.tool_choice)
    constraint = structured_outputs_of(req)
    tool_grammar = tool_constraint(req.tools, *mode, parallel=req.parallel_tool_calls is not False,
                                   auto_parser=ctx.tool_call_parser)  # fmt: skip
    if tool_grammar is not None and mode[0] == "auto" and constraint is not None:
        tool_grammar = None  # the client's own constraint wins over auto's call grammar
    if tool_grammar is not None:
        if constraint is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} cannot be combined with "
                           "another output constraint", param="tool_choice")  # fmt: skip
        constraint = tool_grammar
    if constraint is not None and ctx.reasoning_parser is not None:
        # The grammar holds from the reasoning's end: the thinking itself is free.
        constraint = {**constraint, "reasoning_parser": ctx.reasoning_parser}
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    check_stream_options(req)
    tok = ctx.tokenizer
    text = render_chat(
        tok,
        message_dicts(req.messages),
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        chat_template=req.chat_template,
        tools=req.tools,
        extra=req.chat_template_kwargs,
    )
    ids = await tok.encode_async(text, add_special_tokens=req.add_special_tokens)
    check_prompt_ids(ids, tok.vocab_size, param="messages")
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "messages"
    max_tokens = check_length(ctx, len(ids), requested, param)
    top = req.top_logprobs or 0
    try:
        params = build_sampling_params(
            req, max_tokens=max_tokens, logprobs=top if req.logprobs else None,
            vocab_size=tok.vocab_size, structured_outputs=constraint,
        )  # fmt: skip
    except APIError as e:  # name the field the client sent, not the engine's
        if e.param == "logprobs":
            e.param = "top_logprobs"
        elif e.param == "max_tokens" and req.max_completion_tokens is not None:
            e.param = "max_completion_tokens"
        raise
    if params.structured_outputs is not None and ctx.grammars is not None:
        param = "tool_choice" if tool_grammar is not None else constraint_param(req)
        await ctx.grammars.check(params.structured_outputs, param)
    response_id = new_request_id("chatcmpl")
    choices = [
        Choice(i, f"{response_id}-{i}", ids, p, TextState(tok, ids, p, tok.eos_token_ids))
        for i, p in enumerate(fan_out(params, req.n))
    ]
    gen = ChatGeneration(ctx, response_id, model, choices, logprobs=req.logprobs,
                         top_logprobs=top, tool_mode=mode)  # fmt: skip
    gen.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return gen


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    return await serve_generation(ctx, request, ChatCompletionRequest, build_chat)
