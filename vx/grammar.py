"""Grammars for structured outputs: a request's constraint as llguidance grammar text, compiled
once per (grammar, tokenizer) into a matcher that copies cheaply.

Runs in: the ApiServer (or `vx.LLM`'s process), which compiles each new grammar before
admission to refuse the ones that fail, and each Worker, which compiles it again (one cache
per process) and keeps one matcher per constrained request. Imports no torch: llguidance's
matchers fill numpy bitmasks.

Why llguidance (not xgrammar): it needs no torch (xgrammar's package depends on it), it compiles
lazily (a JSON schema in about a millisecond, with no vocabulary-wide precompute), it bounds its
own work (a schema too large for its limits fails in about 100 ms instead of running on), and a
row's mask costs about 20 µs on this machine's CPU for a JSON schema.

Invariant: `GrammarCache.matcher(text)` returns a fresh matcher in its start state, never one
another request has advanced; a grammar that failed to compile raises `GrammarError` every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from vx.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

__all__ = ["GrammarCache", "GrammarError", "fingerprint_of", "grammar_of", "load_ll_tokenizer"]

#: JSON may put at most this many blanks between two tokens. Why: JSON allows any run, and a
#: small model at temperature 1 can emit blanks until max_tokens (xgrammar's
#: `max_whitespace_cnt` guards the same); pretty-printed JSON needs far fewer.
MAX_JSON_WHITESPACE = 24
_JSON_OPTIONS = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{1,{MAX_JSON_WHITESPACE}}}"}

#: Compiled grammars kept per process (a pristine matcher each, a few KB to a few MB).
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A constraint that cannot be compiled: bad JSON schema, regex, grammar, or too large."""


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of `spec` (deterministic: equal specs give equal texts)."""
    text = _constraint_grammar(spec)
    if spec.reasoning_parser is not None:
        return _after_reasoning(text, opened=spec.reasoning_parser == "deepseek_r1")
    return text


#: The free reasoning before a constraint; `[lazy]` ends it at the first `</think>`.
_REASONING_LARK = """%llguidance {{}}
start: think @{name}
think[lazy]: {opening}THINK_TEXT "</think>"
THINK_TEXT: /(.|\\n)*/
"""


def _after_reasoning(text: str, *, opened: bool) -> str:
    """`text`'s grammar after a `<think>...</think>` block: required and already opened in the
    prompt for deepseek_r1 (a leading `<think>` is still allowed), optional for qwen3."""
    if text.lstrip().startswith("{"):
        grammars = json.loads(text)["grammars"]
    else:
        grammars = [{"lark_grammar": text}]
    inner = dict(grammars[0])
    name = inner.setdefault("name", "constraint")
    opening = '"<think>"? ' if opened else '"<think>" '
    outer = _REASONING_LARK.format(name=name, opening=opening)
    if not opened:
        outer = outer.replace("start: think @", "start: think? @")
    return json.dumps({"grammars": [{"lark_grammar": outer}, inner, *grammars[1:]]})


def _constraint_grammar(spec: StructuredOutputsParams) -> str:
    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            json.loads(schema)  # a clear error for text that is not JSON at all
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=_JSON_OPTIONS
            )
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        if spec.grammar is not None:
            return llguidance.grammar_from("grammar", spec.grammar)
        if spec.structural_tag is not None:
            return _structural_tag_grammar(spec.structural_tag)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None
    raise GrammarError("structured_outputs names no constraint")


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}):
    free text in which each trigger opens one of the structures, whose body follows its schema.
    """
    try:
        tag = json.loads(text)
        structures = tag["structures"]
        triggers = tag["triggers"]
        items = [
            llguidance.StructTag(
                trigger=next(t for t in triggers if s["begin"].startswith(t)),
                begin=s["begin"],
                grammar={"x-guidance": _JSON_OPTIONS, **s.get("schema", {})},
                end=s["end"],
            )
            for s in structures
        ]
        # The tags are text in the models vx serves (`<tool_call>` is no special token).
        lark = llguidance.StructTag.to_grammar(items, assume_special=False)
    except (KeyError, TypeError, StopIteration, AssertionError, json.JSONDecodeError) as e:
        raise GrammarError(f"structural_tag is not a valid structural tag: {e!r}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def load_ll_tokenizer(
    tokenizer_json: str, *, vocab_size: int | None, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (about 0.2 s for a 49K vocabulary).

    `vocab_size` is the width of the logits (it may exceed the tokenizer's); the grammar's end
    allows `eos_token_ids`.
    """
    return llguidance.LLTokenizer(
        tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None
    )


class GrammarCache:
    """Compiled grammars for one tokenizer, keyed by the SHA-256 of grammar text + tokenizer.

    Thread-safe: the ApiServer compiles on worker threads. A compiled grammar is kept as a
    pristine matcher; `matcher` hands out deep copies, each its own parse state.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, fingerprint: str) -> None:
        self.tokenizer = tokenizer
        self._fingerprint = fingerprint.encode()
        self._compiled: OrderedDict[bytes, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_hits = 0

    def key(self, text: str) -> bytes:
        return hashlib.sha256(self._fingerprint + b"\0" + text.encode()).digest()

    def contains(self, text: str) -> bool:
        with self._lock:
            return self.key(text) in self._compiled

    def check(self, text: str) -> bool:
        """Whether `text` is compiled here (a hash, no copy); `GrammarError` where it failed."""
        with self._lock:
            hit = self._compiled.get(self.key(text))
            if hit is not None:
                self._compiled.move_to_end(self.key(text))
                self.num_hits += 1
        if isinstance(hit, str):
            raise GrammarError(hit)
        return hit is not None

    def matcher(self, text: str) -> llguidance.LLMatcher:
        """A matcher for grammar `text` in its start state; `GrammarError` when it fails."""
        key = self.key(text)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                self.num_hits += 1
        if hit is None:
            hit = self._compile(text)
            with self._lock:
                self._compiled[key] = hit
                self.num_compiled += 1
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        if isinstance(hit, str):
            raise GrammarError(hit)
        return hit.deep_copy()

    def _compile(self, text: str) -> llguidance.LLMatcher | str:
        """The pristine matcher, or the error text (failures are cached too)."""
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            return _short_error(matcher.get_error())
        return matcher


def _short_error(error: str) -> str:
    """llguidance's message without its grammar dump (first lines only)."""
    lines = [line for line in error.splitlines() if line.strip()]
    return " ".join(lines[:4])[:500] or "the grammar failed to compile"


def fingerprint_of(tokenizer_json: str, vocab_size: int | None, eos_token_ids: Any) -> str:
    """A short identity of a tokenizer for `GrammarCache` keys."""
    h = hashlib.sha256(tokenizer_json.encode())
    h.update(repr((vocab_size, list(eos_token_ids))).encode())
    return h.hexdigest()[:16]
