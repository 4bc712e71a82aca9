"""GrammarMatchers (vx.gpu.sample.matchers) on the tiny test tokenizer: the masks it puts on a
batch's logits, its state across steps, n rows with one grammar, and preemption's replay."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from tests.models import make_tokenizer
from vx.gpu.sample.matchers import GrammarMatchers
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams

VOCAB = 400  # wider than the tokenizer's, as a model's padded head can be


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(tok_dir: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _new(req_id: str, eos: int, outputs: tuple[int, ...] = (), **constraint: object):
    params = SamplingParams.create(structured_outputs=constraint) if constraint else SamplingParams()
    return NewRequestData(req_id=req_id, prompt_token_ids=[1, 2], sampling_params=params,
                          block_ids=[0], num_computed_tokens=0, output_token_ids=list(outputs),
                          eos_token_id=eos)  # fmt: skip


def _step(new=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=0, scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(req_ids=[], new_block_ids=[],
                                                num_computed_tokens=[]),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=list(finished),
        preempted_req_ids=list(preempted),
    )  # fmt: skip


def _greedy_text(m: GrammarMatchers, hf_tok, req_ids: list[str], eos: int, steps: int) -> list:
    """Run greedy steps on random logits through the masks; return each row's text."""
    gen = torch.Generator().manual_seed(0)
    outs: list[list[int]] = [[] for _ in req_ids]
    live = list(req_ids)
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=gen)
        m.mask_logits(logits, live)
        toks = logits.argmax(-1).tolist()
        m.accept(live, toks)
        for r, t in zip(live, toks, strict=True):
            outs[req_ids.index(r)].append(t)
        live = [r for r, t in zip(live, toks, strict=True) if t != eos]
    return [hf_tok.decode([t for t in o if t != eos]) for o in outs]


def test_each_row_follows_its_own_grammar_and_free_rows_are_untouched(tok_dir, hf_tok) -> None:
    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    m.apply(_step(new=[_new("a", eos, regex="[0-9]{3}-[ab]"), _new("free", eos),
                       _new("c", eos, choice=["hello", "world"])]))  # fmt: skip
    assert m.num_active == 2
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    m.mask_logits(logits, ["a", "free", "c"])
    assert torch.equal(logits[1], before[1])
    assert torch.isinf(logits[0]).sum() > VOCAB - 20  # few tokens start "[0-9]"
    assert not torch.isinf(logits[0, hf_tok.convert_tokens_to_ids("1")])
    assert torch.isinf(logits[0, VOCAB - 1])  # past the tokenizer: never allowed
    text_a, text_c = _greedy_text(m, hf_tok, ["a", "c"], eos, 20)
    assert re.fullmatch(r"[0-9]{3}-[ab]", text_a), text_a
    assert text_c in ("hello", "world")
    m.apply(_step(finished=["a", "c"]))
    assert m.num_active == 0


def test_n_rows_with_one_grammar_keep_separate_states(tok_dir, hf_tok) -> None:
    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}  # fmt: skip
    ids = [f"r-{i}" for i in range(3)]
    m.apply(_step(new=[_new(i, eos, json=schema) for i in ids]))
    import json

    for text in _greedy_text(m, hf_tok, ids, eos, 60):
        assert isinstance(json.loads(text)["x"], int), text


def test_a_preempted_request_resumes_where_it_was(tok_dir, hf_tok) -> None:
    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    digits = [hf_tok.convert_tokens_to_ids(d) for d in "12"]
    m.apply(_step(new=[_new("p", eos, regex="[0-9]{2}x")]))
    m.accept(["p"], digits[:1])  # one token each step
    m.accept(["p"], digits[1:])
    m.apply(_step(preempted=["p"]))
    assert m.num_active == 0
    m.apply(_step(new=[_new("p", eos, outputs=tuple(digits), regex="[0-9]{2}x")]))
    logits = torch.zeros(1, VOCAB)
    m.mask_logits(logits, ["p"])
    allowed = torch.nonzero(~torch.isinf(logits[0])).flatten().tolist()
    assert [hf_tok.decode([t]) for t in allowed] == ["x"]


@pytest.mark.parametrize("density", [0.0, 0.0001, 0.002, 0.05, 0.5, 1.0])
def test_masking_a_row_sparse_or_dense_forbids_exactly_the_cleared_bits(density: float) -> None:
    import numpy as np

    from vx.gpu.sample.matchers import SPARSE_WORDS, _mask_row

    rng = np.random.default_rng(1)
    width = 49152 - 5  # the bitmask covers a few tokens past the logits
    bits = rng.random(49152) < density
    words = np.packbits(bits.astype(np.uint8), bitorder="little").view(np.int32).copy()
    row = rng.standard_normal(width).astype(np.float32)
    expect = np.where(bits[:width], row, -np.inf)
    _mask_row(row, words)
    assert np.array_equal(row, expect)
    assert SPARSE_WORDS < words.size


class _Head:
    """A model's LM head over a random bf16 weight, counting full passes."""

    def __init__(self, gathers: bool) -> None:
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.randn(VOCAB, 16, generator=gen).to(torch.bfloat16)
        self.gathers, self.num_full = gathers, 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.num_full += 1
        return (hidden.float() @ self.weight.float().T).to(torch.bfloat16).float()

    def compute_logits_of(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        if not self.gathers:
            return None
        return (hidden.float() @ self.weight[ids].float().T).to(torch.bfloat16).float()


@pytest.mark.parametrize("gathers", [True, False])
def test_masked_logits_score_only_the_allowed_tokens_where_few(
    tok_dir, hf_tok, gathers, monkeypatch
) -> None:
    """A row whose grammar allows few tokens gets only their logits, equal to the full head's
    masked row; a row that allows many (any text) takes the full head."""
    from vx.gpu.sample import matchers

    monkeypatch.setattr(matchers, "SPARSE_TOKENS", 64)  # of the tokenizer's 300-odd
    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    m.apply(_step(new=[_new("d", eos, regex="[0-9]{3}"), _new("c", eos, choice=["hello", "x"]),
                       _new("any", eos, regex="(.|\n)*")]))  # fmt: skip
    head = _Head(gathers)
    hidden = torch.randn(2, 16).to(torch.bfloat16)
    got = m.masked_logits(head, hidden, ["d", "c"])
    want = head.compute_logits(hidden)
    m.mask_logits(want, ["d", "c"])
    assert torch.equal(got, want)
    assert head.num_full == (1 if gathers else 2)  # only the reference's pass when it gathers
    got = m.masked_logits(head, hidden[:1], ["any"])  # about every token: the full head
    assert head.num_full == (2 if gathers else 3)
    assert torch.isfinite(got).sum() > 64


def test_a_complete_grammar_ends_its_request_whatever_min_tokens_says(tok_dir, hf_tok) -> None:
    """Where the grammar allows nothing but EOS, the row's token is EOS (the sampler, kept
    from EOS by min_tokens, had no allowed token left); free rows, rows whose grammar goes on,
    and failed samples (-1) keep theirs."""
    import numpy as np

    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    one = hf_tok.convert_tokens_to_ids("1")
    m.apply(_step(new=[_new("done", eos, regex="1"), _new("more", eos, regex="1+"),
                       _new("free", eos), _new("failed", eos, regex="1")]))  # fmt: skip
    m.accept(["done", "more", "failed"], [one, one, one])
    tokens = np.array([5, 5, 5, -1])
    got = m.end_where_stopped(["done", "more", "free", "failed"], tokens)
    assert got.tolist() == [eos, 5, 5, -1] and tokens.tolist() == [5, 5, 5, -1]


@pytest.mark.parametrize(("constraint", "exact"), [
    ({"regex": "[a-z]{1,4}( [a-z]{1,4}){1,3}"}, True),
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
     True),
    # llguidance's mask keeps a literal's canonical tokens (after "w", "orld" but not "o");
    # its parser takes any split, and so does `allows`: the output still follows the grammar
    ({"choice": ["hello", "world"]}, False),
])  # fmt: skip
def test_allows_agrees_with_the_mask_on_every_token(tok_dir, hf_tok, constraint, exact) -> None:
    """`allows` (one token's check) allows every token the filled mask allows, EOS included,
    at every step of a random walk through the grammar, and (but for a literal's splits) no
    other; each token it allows is consumed."""
    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    m.apply(_step(new=[_new("r", eos, **constraint)]))
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        logits = torch.zeros(1, VOCAB)
        m.mask_logits(logits, ["r"])
        mask = (~torch.isinf(logits[0])).tolist()
        allowed = [m.allows("r", t) for t in range(VOCAB)]
        assert allowed == mask if exact else all(a or not k for a, k in zip(allowed, mask, strict=True))
        noise = torch.randn(VOCAB, generator=gen)
        token = int(noise.masked_fill(~torch.tensor(allowed), float("-inf")).argmax())
        if token == eos:
            break
        m.accept(["r"], [token])
        assert not m._rows["r"].failed


def test_draft_rows_are_masked_by_the_state_after_the_drafts_before_them(tok_dir, hf_tok) -> None:
    """Speculative decoding: a request's 1 + k rows, row j masked as if drafts[:j] were
    consumed; a draft the grammar forbids leaves the rows after it on its own mask; the
    matcher comes back unchanged, and `accept_lists` consumes the emitted tokens."""
    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    m.apply(_step(new=[_new("a", eos, regex="12[0-9]-x")]))
    one, two, x = (hf_tok.convert_tokens_to_ids(c) for c in ("1", "2", "x"))
    logits = torch.zeros(4, VOCAB)
    m.mask_logits(logits, ["a"] * 4, {"a": [one, two, x]})  # "x" breaks the grammar
    allowed = [torch.nonzero(~torch.isinf(r)).flatten().tolist() for r in logits]
    assert allowed[0] == [one] and allowed[1] == [two]
    assert len(allowed[2]) >= 10 and x not in allowed[2]  # a digit
    assert allowed[3] == allowed[2]  # past the forbidden draft: never used
    plain = torch.zeros(1, VOCAB)
    m.mask_logits(plain, ["a"])  # rolled back: "1" is next again
    assert torch.nonzero(~torch.isinf(plain[0])).flatten().tolist() == [one]
    m.accept_lists(["a"], [[one, two]])
    plain = torch.zeros(1, VOCAB)
    m.mask_logits(plain, ["a"])
    assert torch.nonzero(~torch.isinf(plain[0])).flatten().tolist() == allowed[2]


def test_draft_rows_past_the_grammars_end_get_eos(tok_dir, hf_tok) -> None:
    """With drafts, each row whose state (after the drafts before it) allows EOS alone gets
    EOS after sampling (min_tokens had left it no token); rows before the end, rows of other
    requests and failed samples keep theirs."""
    import numpy as np

    eos = hf_tok.eos_token_id
    m = GrammarMatchers(str(tok_dir), VOCAB)
    m.apply(_step(new=[_new("a", eos, regex="12"), _new("b", eos, regex="[0-9]+")]))
    one, two, three = (hf_tok.convert_tokens_to_ids(c) for c in "123")
    m.mask_logits(torch.zeros(5, VOCAB), ["a", "a", "a", "b", "b"], {"a": [one, two], "b": [one]})
    sampled = np.array([one, two, 7, three, -1])
    got = m.end_masked_rows(["a", "a", "a", "b", "b"], sampled)
    assert got.tolist() == [one, two, eos, three, -1]
    m.mask_logits(torch.zeros(1, VOCAB), ["b"])  # a later mask forgets the ended rows
    assert m.end_masked_rows(["b"], np.array([7])).tolist() == [7]
