"""OpenAI request bodies as msgspec Structs, and their translation to SamplingParams.

Runs in: the ApiServer process. Unknown fields are tolerated (as OpenAI and vLLM do); a field
of the wrong type is a 400 naming it. Ranges are checked once, by `SamplingParams.validate`.

`n > 1` fans out into n engine requests with ids `{id}-{i}`; when a seed is given, choice i
is sampled with `seed + i` (`SamplingParams.for_choice`, as vLLM's parallel sampling), so the n
choices differ from each other yet a repeated request reproduces all of them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from vx.http.errors import APIError, from_validation_error
from vx.sampling_params import SamplingParams

#: OpenAI's documented cap on stop sequences is 4; vLLM allows more. SamplingParams caps at 16.
MAX_STOP_STRINGS = 16
#: Engine requests one HTTP request may fan out to (prompts x n).
MAX_CHOICES = 1024


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints: OpenAI's sampling set plus vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    best_of: int | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's extra and its older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt`: a string, strings, token ids or lists of token ids."""

    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


#: The roles a chat message may take: OpenAI's, less its deprecated `function`.
ROLES = ("system", "developer", "user", "assistant", "tool")


class CompletionMessage(msgspec.Struct, kw_only=True):
    """One chat message as sent. Decoding checks each field's JSON type; what each role allows
    (a known role, content by role, content parts, tool calls) is `chat.message_dicts`'s check,
    so that its errors can name the field and say why. A null or absent `content` are alike.
    """

    # The enum is for /openapi.json; the value is checked by `chat.message_dicts`.
    role: Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(ROLES)})]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[CompletionMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: completion style (`prompt`) or chat style (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[CompletionMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def parse_body(body: bytes, kind: type[Any]) -> Any:
    """Decode a JSON body into `kind`, or raise a 400 APIError."""
    if not body:
        raise APIError(
            400, "the request body is empty; expected a JSON object", code="invalid_json"
        )
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.MsgspecError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop accepts at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    return stops


def check_stream_options(req: Any) -> None:
    """As OpenAI (and vLLM): stream_options only with stream=true."""
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )


def structured_outputs_of(req: _SamplingFields) -> dict[str, Any] | None:
    """The request's one output constraint as `StructuredOutputsParams` fields, or None.

    Sources: `response_format` (json_object, json_schema), vLLM's `structured_outputs` extra,
    and its older `guided_*` names; more than one is a 400.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "response_format json_schema needs json_schema.schema, a JSON object",
                    param="response_format",
                )  # fmt: skip
            found.append(("response_format", {"json": schema}))
        elif kind == "structural_tag":
            found.append(("response_format", {"structural_tag": _json_text(rf)}))
        elif kind != "text":
            raise APIError(
                400, f"response_format type {kind!r} is not one of text, json_object, "
                "json_schema, structural_tag", param="response_format",
            )  # fmt: skip
    if req.structured_outputs:
        so = {k: v for k, v in req.structured_outputs.items() if v is not None and v is not False}
        if isinstance(so.get("structural_tag"), dict):
            so["structural_tag"] = _json_text(so["structural_tag"])
        found.append(("structured_outputs", so))
    for name, field in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {field: value}))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(400, f"give one output constraint, not {names}", param=found[1][0])
    return found[0][1]


def constraint_param(req: _SamplingFields) -> str:
    """The field that carried the request's output constraint, for a 400's `param`."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar"):  # fmt: skip
        value = getattr(req, name)
        if value is not None and (name != "response_format" or value.get("type") != "text"):
            return name
    return "structured_outputs"


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def build_sampling_params(
    req: _SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    structured_outputs: dict[str, Any] | None = None,
) -> SamplingParams:
    """The request's SamplingParams (before `n` fan-out); a 400 APIError when out of range."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (use n)", param="best_of")
    kwargs: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "stop": stop_strings(req.stop),
        "logprobs": logprobs,
    }
    if structured_outputs is not None:
        kwargs["structured_outputs"] = structured_outputs
    for name in (
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "prompt_logprobs",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias:
        bias: dict[int, float] = {}
        for key, value in req.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            if not 0 <= token_id < vocab_size:
                raise APIError(
                    400, f"logit_bias token id {token_id} is out of vocabulary", param="logit_bias"
                )
            bias[token_id] = value
        kwargs["logit_bias"] = bias
    for token_id in req.stop_token_ids or ():
        if not 0 <= token_id < vocab_size:
            raise APIError(
                400, f"stop_token_ids has {token_id}, out of vocabulary", param="stop_token_ids"
            )
    try:
        return SamplingParams.create(**kwargs)
    except ValueError as e:
        message = str(e)
        param = next((name for name in kwargs if message.startswith(name)), None)
        if "structured_outputs" in message:
            param = "structured_outputs"
        raise APIError(400, message, param=param) from None


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The per-choice params (`SamplingParams.for_choice`: choice i samples with seed + i)."""
    return [params.for_choice(i) for i in range(n)]


def check_prompt_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if not token_ids:
        raise APIError(400, "the prompt is empty", param=param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of vocabulary (size {vocab_size})", param=param)


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * max(n, 1) > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n)", param="n")


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """Normalise `prompt` to a list of strings or token-id lists; 400 on anything else."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in prompt
    ):
        return [list(p) for p in prompt]
    raise APIError(
        400,
        "prompt must be a string, a list of strings, a list of token ids, or a list of lists "
        "of token ids",
        param="prompt",
    )
