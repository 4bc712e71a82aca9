"""Incremental detokenization and stop strings (vx.http.detokenizer), plus the tokenizer."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings, strategies as st

from vx.http.detokenizer import IncrementalDetokenizer, TextState, _held_back
from vx.http.tokenizer import Tokenizer, load_tokenizer
from vx.sampling_params import SamplingParams

TEXTS = [
    "Hello wörld! 😀 one two three",
    "日本語のテキストも少し。",
    "Grüße aus Köln, café crème 🎉👍",
    "plain ascii text only",
]


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], prompt: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    pieces, i = [], 0
    for size in chunks:
        pieces.append(detok.append(ids[i : i + size]))
        i += size
        if i >= len(ids):
            break
    pieces.append(detok.append(ids[i:]))
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_one_token_at_a_time(
    tokenizer: Tokenizer, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(
        tokenizer, ids, [1] * len(ids), tokenizer.encode("prompt:", add_special_tokens=False)
    )
    assert "".join(pieces) == tokenizer.decode(ids) == text
    # A multi-byte character is never split: no piece carries a replacement character.
    assert not any("\ufffd" in p for p in pieces)


def test_emoji_spans_several_tokens_and_is_emitted_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the test tokenizer should split the emoji into byte tokens"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    outs = [detok.append([t]) for t in ids]
    assert outs[:-1] == [""] * (len(ids) - 1)
    assert outs[-1] == "😀"


@settings(max_examples=60, deadline=None)
@given(
    text_idx=st.integers(0, len(TEXTS) - 1),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=40),
)
def test_incremental_any_chunking(
    tokenizer_dir: pathlib.Path, text_idx: int, chunks: list[int]
) -> None:
    tok = _cached(tokenizer_dir)
    text = " ".join(TEXTS[text_idx:] + TEXTS[:text_idx])
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(_stream(tok, ids, chunks, [])) == text


_TOKS: dict[str, Tokenizer] = {}


def _cached(path: pathlib.Path) -> Tokenizer:
    if str(path) not in _TOKS:
        _TOKS[str(path)] = load_tokenizer(path)
    return _TOKS[str(path)]


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two", add_special_tokens=False) + [tokenizer.eos_token_id]
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert keep.append(ids) + keep.flush() == "one two<|im_end|>"
    assert skip.append(ids) + skip.flush() == "one two"


def test_held_back_is_longest_prefix_suffix() -> None:
    assert _held_back("abc thr", 0, ["three"]) == 3
    assert _held_back("abc th", 0, ["three", "hx"]) == 2
    assert _held_back("abc", 0, ["three"]) == 0
    assert _held_back("abc t", 4, ["three"]) == 1
    assert _held_back("abc t", 5, ["three"]) == 0  # nothing unemitted to hold


def _run_state(
    tok: Tokenizer, text: str, params: SamplingParams, step: int = 1
) -> tuple[TextState, list[str]]:
    ids = tok.encode(text, add_special_tokens=False)
    state = TextState(tok, [], params, tok.eos_token_ids)
    deltas = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        stopped = state.update(ids[i : i + step], "length" if last else None)
        deltas.append(state.take_delta())
        if stopped or state.finished:
            break
    return state, deltas


@pytest.mark.parametrize("step", [1, 2, 3])
def test_stop_string_across_tokens_never_leaks(tokenizer: Tokenizer, step: int) -> None:
    params = SamplingParams.create(stop=["ee fo"])
    state, deltas = _run_state(tokenizer, "one two three four five", params, step)
    assert state.text == "one two thr"
    assert "".join(deltas) == "one two thr"
    assert state.finish_reason == "stop" and state.stop_reason == "ee fo"
    for i in range(len(deltas)):
        assert "ee fo" not in "".join(deltas[: i + 1])


def test_stop_string_included(tokenizer: Tokenizer) -> None:
    params = SamplingParams.create(stop=["three"], include_stop_str_in_output=True)
    state, deltas = _run_state(tokenizer, "one two three four five", params)
    assert state.text == "one two three" == "".join(deltas)


def test_partial_match_released_when_it_fails(tokenizer: Tokenizer) -> None:
    params = SamplingParams.create(stop=["two thousand"])
    state, deltas = _run_state(tokenizer, "one two three four", params)
    assert state.finish_reason == "length"
    assert "".join(deltas) == "one two three four"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    params = SamplingParams.create(stop=["four", "two"])
    state, _ = _run_state(tokenizer, "one two three four", params, step=100)
    assert state.text == "one " and state.stop_reason == "two"


def test_min_tokens_defers_stop_strings(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three two", add_special_tokens=False)
    params = SamplingParams.create(stop=["two"], min_tokens=len(ids) - 1, max_tokens=50)
    state = TextState(tokenizer, [], params)
    for t in ids[:-1]:
        assert not state.update([t], None)
    assert state.update(ids[-1:], None)
    assert state.text == "one two three "


def test_stop_token_not_in_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two", add_special_tokens=False)
    stop_id = tokenizer.encode(" three", add_special_tokens=False)[0]
    params = SamplingParams.create(stop_token_ids=[stop_id], skip_special_tokens=False)
    state = TextState(tokenizer, [], params, tokenizer.eos_token_ids)
    state.update([*ids, stop_id], "stop", stop_id)
    assert state.text == "one two" and state.stop_reason == stop_id
    eos = TextState(
        tokenizer, [], SamplingParams.create(skip_special_tokens=False), tokenizer.eos_token_ids
    )
    eos.update([*ids, tokenizer.eos_token_id], "stop", tokenizer.eos_token_id)
    assert eos.text == "one two" and eos.stop_reason is None  # EOS: no stop_reason (vLLM)


def test_tokenizer_files(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == (2, 0)  # tokenizer EOS + generation_config's list
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in emoji) == "😀".encode()


def test_chat_template_errors_are_value_errors(tokenizer: Tokenizer) -> None:
    from vx.http.tokenizer import ChatTemplateError

    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([], chat_template="{{ raise_exception('no') }}")
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([], chat_template="{% for %}")


def test_loads_a_transformers_saved_tokenizer(tmp_path: pathlib.Path) -> None:
    """tests/models.py saves through transformers (a different file layout)."""
    from tests.models import CHAT_TEMPLATE, make_tokenizer

    make_tokenizer().save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id is not None
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
