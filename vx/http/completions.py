"""POST /v1/completions: text or token-id prompts, echo, logprobs, n, streaming.

Runs in: the ApiServer process. Prompts may be a string, a list of strings, a list of token ids
or a list of token-id lists (the form `vx bench serve` uses, so every server sees the same
lengths). Choice index = prompt index x n + i, as in OpenAI's API.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from vx.http.access_log import SCOPE_KEY
from vx.http.detokenizer import TextState
from vx.http.errors import APIError, context_length_error, error_response
from vx.http.generation import Choice, Generation, ServerContext, new_request_id
from vx.http.middleware import BodyTooLargeError
from vx.http.protocol import (
    CompletionRequest,
    build_sampling_params,
    check_num_choices,
    check_prompt_ids,
    check_stream_options,
    completion_prompts,
    constraint_param,
    fan_out,
    parse_body,
    structured_outputs_of,
)

logger = logging.getLogger(__name__)


async def read_body(request: Request) -> bytes:
    """The whole body; a 413 APIError when it passes the limit while streaming in."""
    try:
        return await request.body()
    except BodyTooLargeError:
        raise APIError(413, "The request body is too large.", code="request_too_large") from None


def check_length(ctx: ServerContext, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """The effective max_tokens (None: the rest of the context); 400 when it cannot fit."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise context_length_error(prompt_len, None, limit, param=param)
    if max_tokens is None:
        return limit - prompt_len
    if max_tokens >= 1 and prompt_len + max_tokens > limit:
        raise context_length_error(prompt_len, max_tokens, limit, param=param)
    return max_tokens


class CompletionGeneration(Generation):
    object_name = "text_completion"

    def __init__(self, *args: Any, echo: bool, logprobs: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.logprobs = logprobs

    def _prompt_text(self, c: Choice) -> str:
        if c.prompt_text is None:
            c.prompt_text = self.ctx.tokenizer.decode(c.prompt_token_ids)
        return c.prompt_text

    def _logprobs(self, c: Choice, rows: tuple[list[list[int]], list[list[float]]], offset: int,
                  with_prompt: bool) -> tuple[dict[str, Any], int]:  # fmt: skip
        """OpenAI's completion logprobs for `rows`; also returns the text offset after them."""
        tok = self.ctx.tokenizer
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if with_prompt:
            prompt_rows = c.prompt_logprobs
            ids = c.prompt_token_ids
            # The engine sends rows for prompt positions 1.. (position 0 has no context).
            skip = len(ids) - len(prompt_rows.token_ids) if prompt_rows is not None else len(ids)
            for pos, token_id in enumerate(ids):
                text = tok.token_text(token_id)
                row = pos - skip
                tokens.append(text)
                offsets.append(offset)
                offset += len(text)
                if prompt_rows is None or row < 0:
                    token_logprobs.append(None)
                    top.append(None)
                    continue
                token_logprobs.append(prompt_rows.logprobs[row][0])
                top.append(_top(tok, prompt_rows.token_ids[row], prompt_rows.logprobs[row]))
        for ids_row, values in zip(*rows, strict=True):
            text = tok.token_text(ids_row[0])
            tokens.append(text)
            token_logprobs.append(values[0])
            top.append(_top(tok, ids_row, values))
            offsets.append(offset)
            offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
        return body, offset

    def delta_chunk(self, c: Choice, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        first = not c.sent_first
        c.sent_first = True
        prefix = self._prompt_text(c) if first and self.echo else ""
        logprobs = None
        if self.logprobs is not None:
            rows = self.take_logprob_rows(c)
            if rows[0] or (first and self.echo):
                logprobs, c.lp_text_offset = self._logprobs(
                    c, rows, c.lp_text_offset, with_prompt=first and self.echo
                )
            # The prompt's rows go out with the first chunk alone: a stream holds them no
            # longer (a stalled one would, for every choice, until its stall abort).
            c.prompt_logprobs = None
        if not (prefix or text or logprobs or finish_reason):
            return None
        choice = {
            "index": c.index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": c.state.stop_reason if finish_reason else None,
        }
        return self.chunk([choice])

    def final_body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            prefix = self._prompt_text(c) if self.echo else ""
            logprobs = None
            if self.logprobs is not None:
                rows = (c.lp_token_ids, c.lp_values)
                logprobs, _ = self._logprobs(c, rows, 0, with_prompt=self.echo)
            choices.append(
                {
                    "index": c.index,
                    "text": prefix + c.state.text,
                    "logprobs": logprobs,
                    "finish_reason": c.state.finish_reason,
                    "stop_reason": c.state.stop_reason,
                }
            )
        body = self.chunk(choices)
        body["usage"] = self.usage()
        return body


def _top(tok: Any, ids: list[int], values: list[float]) -> dict[str, float]:
    return {tok.token_text(t): v for t, v in zip(ids, values, strict=True)}


async def build_completion(ctx: ServerContext, req: CompletionRequest) -> CompletionGeneration:
    """Validate and tokenize; every failure here is an APIError (4xx/503), nothing admitted."""
    model = ctx.check_model(req.model)
    ctx.check_available()
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    check_stream_options(req)
    tok = ctx.tokenizer
    prompts: list[tuple[list[int], str | None]] = []
    raw_prompts = completion_prompts(req.prompt)
    check_num_choices(len(raw_prompts), req.n)
    for p in raw_prompts:
        if isinstance(p, str):
            ids = await tok.encode_async(p, add_special_tokens=req.add_special_tokens)
            prompts.append((ids, p))
        else:
            prompts.append((p, None))
    for ids, _ in prompts:
        check_prompt_ids(ids, tok.vocab_size)
    lengths = [check_length(ctx, len(ids), req.max_tokens, "prompt") for ids, _ in prompts]
    constraint = structured_outputs_of(req)
    logprobs = req.logprobs
    response_id = new_request_id("cmpl")
    choices: list[Choice] = []
    for p_idx, ((ids, text), max_tokens) in enumerate(zip(prompts, lengths, strict=True)):
        params = build_sampling_params(
            req, max_tokens=max_tokens, logprobs=logprobs, vocab_size=tok.vocab_size,
            structured_outputs=constraint,
        )  # fmt: skip
        if p_idx == 0 and params.structured_outputs is not None and ctx.grammars is not None:
            await ctx.grammars.check(params.structured_outputs, constraint_param(req))
        if req.echo and logprobs is not None and params.prompt_logprobs is None:
            params = msgspec.structs.replace(params, prompt_logprobs=logprobs)
        for i, choice_params in enumerate(fan_out(params, req.n)):
            index = p_idx * req.n + i
            state = TextState(tok, ids, choice_params, tok.eos_token_ids)
            choices.append(
                Choice(index, f"{response_id}-{index}", ids, choice_params, state, prompt_text=text)
            )
    gen = CompletionGeneration(ctx, response_id, model, choices, echo=req.echo, logprobs=logprobs)
    gen.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return gen


async def serve_generation(
    ctx: ServerContext, request: Request, schema: type[Any], build: Any
) -> Response:
    """The shared life of a generation request: count it, parse and validate the body, submit
    it, then stream it or wait for it (both endpoints differ only in `schema` and `build`)."""
    ctx.metrics.received.inc()
    try:
        req = parse_body(await read_body(request), schema)
        gen = await build(ctx, req)
        gen.access = request.scope.get(SCOPE_KEY)
        gen.headers = request.scope["headers"]
        gen.submit()
    except APIError as e:
        ctx.metrics.rejected(e.status)
        return e.response()
    except Exception:  # a bug in validation: still counted, still the envelope
        logger.exception("request refused by an unexpected error")
        ctx.metrics.rejected(500)
        return error_response(500, "Internal server error.", code="internal_error")
    gen.peer = f"{request.client.host}:{request.client.port}" if request.client else None
    if req.stream:
        return gen.streaming_response()  # type: ignore[no-any-return]
    try:
        return await gen.complete(request.receive)  # type: ignore[no-any-return]
    except APIError as e:
        return e.response()


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    return await serve_generation(ctx, request, CompletionRequest, build_completion)
