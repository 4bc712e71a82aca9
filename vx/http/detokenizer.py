"""Incremental detokenization and stop strings, per generated sequence.

Runs in: the ApiServer process. The EngineCore only ever sees token ids; text exists only here.

`IncrementalDetokenizer` follows vLLM's prefix/read offset method: it decodes a short window of
ids twice (`[prefix:read]` and `[prefix:]`) and emits the difference, so tokenizers whose
decoders depend on neighbours (a leading-space marker, merges) give the same text as a full
decode. While the window ends in U+FFFD (a UTF-8 character split across byte-level tokens) it
emits nothing, so a multi-byte character is never split across deltas.

`TextState` adds the OpenAI stop-string rules on top: the text never contains anything after a
stop string, and a stream never shows a partial stop string (the longest suffix that is a prefix
of some stop string is held back until the next delta decides it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vx.http.tokenizer import Tokenizer
    from vx.sampling_params import SamplingParams

#: Prompt ids kept as left context for the first output tokens (vLLM uses the same five).
INITIAL_CONTEXT_TOKENS = 5
#: The id window is trimmed when the consumed prefix grows past this many ids.
TRIM_AT = 64


class IncrementalDetokenizer:
    """Turns appended token ids into text deltas that concatenate to the full decode.

    Invariant: `_ids[_prefix:_read]` is the context already turned into text; ids from `_read`
    on are pending (not yet emitted because their text ended in an incomplete character).
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip_special", "_tokenizer")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def append(self, token_ids: Sequence[int]) -> str:
        """Add ids; returns the text they completed (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of any pending ids, even if it ends in an incomplete character."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix : self._read], skip_special_tokens=self._skip_special
        )
        full_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new_text


def _held_back(text: str, start: int, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a stop string."""
    best = 0
    room = len(text) - start
    for stop in stops:
        for k in range(min(len(stop) - 1, room), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class TextState:
    """The text of one generated sequence, with stop strings and stream hold-back applied.

    Invariants: `text` never extends past a matched stop string (nor includes it unless
    `include_stop_str_in_output`); `text[:emitted]` has been handed out and is final; once
    `finish_reason` is set, `update` accepts nothing more.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._user_stop_ids = frozenset(params.stop_token_ids)
        self._stop_ids = self._user_stop_ids | frozenset(eos_token_ids)
        self.text = ""
        self.emitted = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(
        self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | None = None
    ) -> bool:
        """Add one merged delta. Returns True when a stop string ended the sequence here
        (the caller must then abort the engine request, which does not know about it)."""
        if self.finished:
            return False
        self.token_ids.extend(token_ids)
        text_ids: Sequence[int] = token_ids
        if (
            finish_reason == "stop"
            and token_ids
            and not self._include_stop
            and (token_ids[-1] == stop_reason or token_ids[-1] in self._stop_ids)
        ):
            text_ids = token_ids[:-1]  # the stop token is not part of the text
        old_len = len(self.text)
        self.text += self._detok.append(text_ids)
        if finish_reason is not None:
            self.text += self._detok.flush()
        # As in vLLM, stop strings count only once more than min_tokens tokens exist.
        if self._stops and len(self.token_ids) > self._min_tokens:
            if self._check_stop_strings(old_len):
                return True
        if finish_reason is not None:
            self.finish_reason = finish_reason
            # vLLM's convention: stop_reason names a stop string or a user stop token, and
            # is None when EOS (or the length cap) ended the sequence.
            if stop_reason is not None and stop_reason in self._user_stop_ids:
                self.stop_reason = stop_reason
        return False

    def _check_stop_strings(self, old_len: int) -> bool:
        # Each stop string is searched only where it could end inside the new text. When it is
        # excluded from the output, a match never starts inside emitted text (the hold-back
        # keeps every possible start unemitted); when it is included, its emitted head is fine.
        floor = 0 if self._include_stop else self.emitted
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = self.text.find(stop, max(floor, old_len - len(stop) + 1, 0))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        self.text = self.text[: i + len(stop)] if self._include_stop else self.text[:i]
        self.finish_reason = "stop"
        self.stop_reason = stop
        return True

    def take_delta(self) -> str:
        """Text not handed out yet, minus a possible partial stop string at its end."""
        end = len(self.text)
        if self._stops and not self.finished and not self._include_stop:
            end -= _held_back(self.text, self.emitted, self._stops)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
