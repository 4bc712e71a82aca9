"""vx.grammar: each constraint kind compiles, a grammar compiles once per (text, tokenizer),
copies are independent, and failures are GrammarErrors every time (tiny test tokenizer)."""

from __future__ import annotations

import json

import pytest

from tests.models import _tokenizer_json
from vx.grammar import GrammarCache, GrammarError, fingerprint_of, grammar_of, load_ll_tokenizer
from vx.sampling_params import StructuredOutputsParams as Spec


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    text = _tokenizer_json(384)
    tok = load_ll_tokenizer(text, vocab_size=400, eos_token_ids=[0])
    return GrammarCache(tok, fingerprint_of(text, 400, [0]))


TAG = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
       "triggers": ["<f>"]}  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        Spec(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        Spec(json='{"type": "array"}'),
        Spec(json_object=True),
        Spec(regex="[0-9]{3}"),
        Spec(choice=["yes", "no"]),
        Spec(grammar='root ::= "a" | "b"'),  # GBNF
        Spec(grammar='start: "x"+'),  # Lark
        Spec(structural_tag=json.dumps(TAG)),
        Spec(regex="[0-9]+", reasoning_parser="qwen3"),
    ],
    ids=lambda s: next(k for k in ("json", "regex", "choice", "grammar", "structural_tag",
                                   "json_object") if getattr(s, k)),  # fmt: skip
)
def test_each_kind_compiles(cache: GrammarCache, spec: Spec) -> None:
    spec.validate()
    matcher = cache.matcher(grammar_of(spec))
    assert not matcher.is_error()


@pytest.mark.parametrize(
    "spec",
    [Spec(regex="[a-"), Spec(json="{bad"), Spec(json={"type": "no-such-type"}),
     Spec(grammar="root ::= missing"), Spec(structural_tag='{"structures": 1}')],
)  # fmt: skip
def test_failures_are_grammar_errors_every_time(cache: GrammarCache, spec: Spec) -> None:
    for _ in range(2):
        with pytest.raises(GrammarError):
            cache.matcher(grammar_of(spec))


def test_compiled_once_and_copies_are_independent(cache: GrammarCache) -> None:
    text = grammar_of(Spec(regex="ab|ac"))
    compiled = cache.num_compiled
    first, second = cache.matcher(text), cache.matcher(text)
    assert cache.num_compiled == compiled + 1 and cache.check(text)
    tok = cache.tokenizer
    assert first.consume_tokens(tok.tokenize_str("a"))
    assert first.consume_tokens(tok.tokenize_str("b")) and first.is_accepting()
    assert not second.is_accepting()  # still at the start


def test_exactly_one_constraint_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Spec(regex="a", choice=["a"]).validate()
    with pytest.raises(ValueError, match="exactly one"):
        Spec().validate()
    with pytest.raises(ValueError, match="reasoning_parser"):
        Spec(regex="a", reasoning_parser="nope").validate()
