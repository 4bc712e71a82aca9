"""SamplingParams: the per-request sampling settings, shared by every process.

Built and validated in the ApiServer (or by `vx.LLM`), carried to the EngineCore inside
`AddRequest`, and on to the Workers inside `NewRequestData`. It is a frozen msgspec Struct, so
it crosses the rings as msgpack with no pickle. Imports no torch.

Invariant: an instance that exists has passed `validate()`; every constructor path in vx calls
it (`SamplingParams.create`).
"""

from __future__ import annotations

from typing import Any

import msgspec

#: Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
#: The OpenAI API allows at most 20 top logprobs.
MAX_LOGPROBS = 20


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One output constraint (vLLM's `StructuredOutputsParams`): exactly one field is set.

    `json` is a JSON schema (a dict, or its JSON text); `json_object` any JSON object; `regex`
    a regular expression (Rust `regex` syntax); `choice` one of the strings; `grammar` a Lark or
    GBNF grammar; `structural_tag` vLLM's structural-tag JSON. The text form the Worker compiles
    is `vx.grammar.grammar_of(self)`: checked by the ApiServer (or `vx.LLM`) before admission.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    #: Set by the ApiServer's `--reasoning-parser` ("deepseek_r1", "qwen3"): the constraint
    #: applies after the reasoning's `</think>`, the reasoning itself is free.
    reasoning_parser: str | None = None

    def validate(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "structural_tag")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {given or 'none'}"
            )
        if self.reasoning_parser not in (None, "deepseek_r1", "qwen3"):
            raise ValueError(f"unknown reasoning_parser {self.reasoning_parser!r}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The OpenAI sampling set plus vLLM's extras.

    `stop` strings are applied by the ApiServer (it owns the text); everything else is applied
    by the EngineCore (stop ids, lengths) or the Worker's sampler (the distribution).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: The grammar the output must follow; None: unconstrained (and it costs nothing).
    structured_outputs: StructuredOutputsParams | None = None

    @classmethod
    def create(cls, **kwargs: object) -> SamplingParams:
        """Build and validate; raises ValueError with a message naming the bad field."""
        try:
            params = msgspec.convert(kwargs, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(str(e)) from None
        params.validate()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice `index` of a request's n: with a seed, choice i samples with
        seed + i (wrapped to 64 bits; vLLM's parallel sampling does the same), so the n choices
        differ, a repeated request gives every one of them back, and choice i of any n is the
        request with seed + i alone, over HTTP and in `vx.LLM` alike. Without a seed every
        choice draws from the engine's stream."""
        if self.seed is None or index == 0:
            return self
        return msgspec.structs.replace(self, seed=(self.seed + index + 2**63) % 2**64 - 2**63)

    def validate(self) -> None:
        """Raise ValueError with a clear message for any value out of range."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.n > 128:
            raise ValueError(f"n must be at most 128, got {self.n}")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError("seed must fit in 64 bits")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    raise ValueError(f"logit_bias has a negative token id {token_id}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if len(self.stop) > 16:
            raise ValueError("stop accepts at most 16 strings")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
