"""Tests for vx.gpu.sample.sampler and vx.gpu.sample.metadata (CPU, small vocabularies)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vx.gpu.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    compute_logprobs_rows,
    step_seed,
)
from vx.sampling_params import SamplingParams

CPU = torch.device("cpu")
#: A distribution with a clear order: the nucleus and min-p sets below are computed from it.
PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


def sp(**kwargs: object) -> SamplingParams:
    return SamplingParams.create(**kwargs)


def build(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    eos: list[int | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        eos_token_ids=eos or [None] * n,
        vocab_size=vocab_size,
        device=CPU,
    )


def sample(
    params: list[SamplingParams],
    logits: torch.Tensor,
    *,
    sampler: Sampler | None = None,
    **kwargs: object,
):
    metadata = build(params, logits.shape[1], **kwargs)
    return (sampler or Sampler())(logits.clone(), metadata)


def draw_many(
    params: SamplingParams, probs: list[float], num_draws: int, **sampler_kwargs: object
) -> torch.Tensor:
    """Sample one distribution `num_draws` times in one batch; returns the token counts."""
    logits = torch.tensor(probs).log().expand(num_draws, -1).contiguous()
    sampler = Sampler(generator=torch.Generator().manual_seed(0), **sampler_kwargs)
    out = sample([params] * num_draws, logits, sampler=sampler)
    return torch.bincount(out.sampled_token_ids, minlength=len(probs))


def assert_matches(counts: torch.Tensor, support: list[int], probs: list[float]) -> None:
    """Only `support` appears, with frequencies of the renormalised probs (chi-square, p=1e-3)."""
    outside = [i for i in range(len(counts)) if i not in support]
    assert counts[outside].sum() == 0, counts
    total = counts.sum().item()
    mass = sum(probs[i] for i in support)
    chi2 = sum(
        (counts[i].item() - total * probs[i] / mass) ** 2 / (total * probs[i] / mass)
        for i in support
    )
    # 99.9th percentiles of chi-square with 1..4 degrees of freedom.
    critical = {0: 0.0, 1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[len(support) - 1]
    assert chi2 <= critical, (counts, chi2)


# ───────────────────────────── greedy ─────────────────────────────


def test_greedy_is_argmax_and_fast_path() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    logits[3, 7] = logits[3, 9] = 50.0  # a tie: the lowest id wins
    metadata = build([sp(temperature=0.0)] * 8, 100)
    assert metadata.is_argmax_only and metadata.all_greedy
    assert metadata.temperature is None and metadata.output_token_index is None
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3] == 7
    assert out.logprobs is None and out.ranks is None


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 9e-6])
def test_temperature_below_epsilon_is_greedy_in_a_mixed_batch(temperature: float) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [sp(temperature=temperature), sp(temperature=1.0)] * 3
    metadata = build(params, 50)
    assert not metadata.all_greedy and not metadata.all_random
    for _ in range(5):
        out = Sampler()(logits.clone(), metadata)
        assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(dim=-1))


def test_tiny_temperature_is_clamped_and_nearly_greedy() -> None:
    logits = torch.tensor([[1.0, 1.5, 0.0, -1.0]]).expand(200, -1).contiguous()
    metadata = build([sp(temperature=1e-4)] * 200, 4)
    assert metadata.temperature is not None
    assert math.isclose(metadata.temperature.min().item(), 0.01, rel_tol=1e-6)
    out = Sampler()(logits, metadata)
    assert (out.sampled_token_ids == 1).all()


# ───────────────────────────── distributions ─────────────────────────────


def test_temperature_one_matches_the_distribution() -> None:
    counts = draw_many(sp(temperature=1.0), PROBS, 10000)
    assert_matches(counts, [0, 1, 2, 3, 4], PROBS)


def test_temperature_sharpens() -> None:
    counts = draw_many(sp(temperature=0.5), PROBS, 10000)
    sharpened = [p**2 for p in PROBS]
    assert_matches(counts, [0, 1, 2, 3, 4], sharpened)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_top_k_keeps_only_the_top_k(top_k: int) -> None:
    counts = draw_many(sp(top_k=top_k), PROBS, 10000)
    assert_matches(counts, list(range(top_k)), PROBS)


@pytest.mark.parametrize("top_k", [0, -1, 5, 100])
def test_top_k_off_or_not_below_vocab_keeps_everything(top_k: int) -> None:
    metadata = build([sp(top_k=top_k)], 5)
    assert metadata.top_k is None
    counts = draw_many(sp(top_k=top_k), PROBS, 10000)
    assert_matches(counts, [0, 1, 2, 3, 4], PROBS)


@pytest.mark.parametrize("candidates", [0, 2, 256])
@pytest.mark.parametrize(
    ("top_p", "support"),
    [
        (0.3, [0]),
        (0.39, [0]),
        (0.41, [0, 1]),
        (0.8, [0, 1, 2]),
        (0.9, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3, 4]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(
    top_p: float, support: list[int], candidates: int
) -> None:
    # candidates=2 makes most nuclei miss the candidate set, forcing the sorted fallback.
    counts = draw_many(sp(top_p=top_p), PROBS, 10000, num_top_p_candidates=candidates)
    assert_matches(counts, support, PROBS)


@pytest.mark.parametrize("candidates", [0, 1, 256])
def test_top_p_applies_to_the_top_k_renormalised_distribution(candidates: int) -> None:
    # After top-2, token 0 has 0.4 / 0.7 = 0.57 >= 0.55: alone. Without top-k it needs token 1.
    counts = draw_many(sp(top_k=2, top_p=0.55), PROBS, 10000, num_top_p_candidates=candidates)
    assert_matches(counts, [0], PROBS)
    counts = draw_many(sp(top_p=0.55), PROBS, 10000, num_top_p_candidates=candidates)
    assert_matches(counts, [0, 1], PROBS)


def test_top_p_rows_mixed_with_other_rows() -> None:
    rows = [sp(top_p=0.8), sp(), sp(top_p=0.41, top_k=3), sp(temperature=0.0)] * 2500
    logits = torch.tensor(PROBS).log().expand(len(rows), -1).contiguous()
    sampler = Sampler(generator=torch.Generator().manual_seed(3), num_top_p_candidates=1)
    tokens = sample(rows, logits, sampler=sampler).sampled_token_ids.view(-1, 4)
    assert_matches(torch.bincount(tokens[:, 0], minlength=5), [0, 1, 2], PROBS)
    assert_matches(torch.bincount(tokens[:, 1], minlength=5), [0, 1, 2, 3, 4], PROBS)
    # Top-3 first: token 0 then holds 0.4 / 0.85 = 0.47 >= 0.41 of the mass, alone.
    assert_matches(torch.bincount(tokens[:, 2], minlength=5), [0], PROBS)
    assert (tokens[:, 3] == 0).all()


@pytest.mark.parametrize(("min_p", "support"), [(0.3, [0, 1, 2]), (0.2, [0, 1, 2, 3]), (0.8, [0])])
def test_min_p(min_p: float, support: list[int]) -> None:
    counts = draw_many(sp(min_p=min_p), PROBS, 10000)
    assert_matches(counts, support, PROBS)


def test_min_p_applies_after_temperature() -> None:
    # At T = 0.5 the probs go as p**2: relative to the top, [1, .56, .14, .06, .02].
    sharpened = [p**2 for p in PROBS]
    counts = draw_many(sp(temperature=0.5, min_p=0.3), PROBS, 10000)
    assert_matches(counts, [0, 1], sharpened)


def test_top_p_applies_after_temperature_and_min_p() -> None:
    # vLLM's order: temperature, min-p, then top-k/top-p over what is left (renormalised).
    sharpened = [p**2 for p in PROBS]  # T = 0.5: [.56, .32, .08, .04, .01] once normalised
    counts = draw_many(sp(temperature=0.5, top_p=0.8), PROBS, 10000)
    assert_matches(counts, [0, 1], sharpened)
    # min-p 0.3 leaves {0, 1, 2} = [.47, .35, .18]; then 0.82 >= 0.8 is reached by {0, 1}.
    counts = draw_many(sp(min_p=0.3, top_p=0.8), PROBS, 10000)
    assert_matches(counts, [0, 1], PROBS)


# ───────────────────────────── seeds ─────────────────────────────


def _seeded_sequence(row: int, companions: list[SamplingParams], steps: int = 8) -> list[int]:
    """Sample the seeded request at `row` among `companions` for `steps` output positions."""
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    target = torch.randn(vocab, generator=generator)
    sampler = Sampler(generator=torch.Generator().manual_seed(row * 7 + len(companions)))
    tokens: list[int] = []
    for _ in range(steps):
        params = list(companions)
        params.insert(row, sp(temperature=1.0, seed=1234, top_p=0.95))
        logits = torch.randn(len(params), vocab, generator=generator)
        logits[row] = target
        outputs = [[5] * (i % 3) for i in range(len(params))]
        outputs[row] = list(tokens)
        out = sample(params, logits, sampler=sampler, outputs=outputs)
        tokens.append(int(out.sampled_token_ids[row]))
    return tokens


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    alone = _seeded_sequence(0, [])
    others = [sp(temperature=0.8), sp(temperature=0.0), sp(seed=99), sp(top_k=3), sp(min_p=0.1)]
    assert _seeded_sequence(3, others) == alone
    assert _seeded_sequence(5, others) == alone
    assert _seeded_sequence(1, others[:2]) == alone
    assert len(set(alone)) > 1  # the position feeds the seed: not the same token every step


def test_seeded_row_is_reproduced_after_recompute() -> None:
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4))
    params = [sp(seed=7)]
    first = sample(params, logits, outputs=[[1, 2, 3]]).sampled_token_ids
    again = sample(params, logits, outputs=[[1, 2, 3]]).sampled_token_ids
    assert torch.equal(first, again)


def test_unseeded_rows_differ_between_calls() -> None:
    logits = torch.zeros(16, 1000)
    sampler = Sampler()
    first = sample([sp()] * 16, logits, sampler=sampler).sampled_token_ids
    second = sample([sp()] * 16, logits, sampler=sampler).sampled_token_ids
    assert not torch.equal(first, second)


def test_step_seed_is_stable() -> None:
    # Pinned: a change here silently changes every seeded request's tokens.
    assert step_seed(0, 0) == 16294208416658607535
    assert step_seed(1234, 7) == 2370596843569455844
    assert step_seed(-1, 0) == 15999695513772384452
    assert len({step_seed(s, p) for s in range(50) for p in range(50)}) == 2500


# ───────────────────────────── logits processing ─────────────────────────────


def test_penalties_exact() -> None:
    raw = [2.0, -1.0, 0.5, -2.0, 1.0, 3.0]
    logits = torch.tensor([raw, raw])
    params = [
        sp(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        sp(temperature=0.0),
    ]
    metadata = build(params, 6, prompts=[[0, 3], [0, 3]], outputs=[[1, 1, 4], [1, 1, 4]])
    assert not metadata.no_penalties and not metadata.is_argmax_only
    out = apply_penalties(logits.clone(), metadata)
    # Seen {0, 1, 3, 4}: positives halved, negatives doubled; then -0.5 per output occurrence
    # (token 1 twice, token 4 once), then -0.25 per distinct output token.
    expected = [1.0, -2.0 - 1.0 - 0.25, 0.5, -4.0, 0.5 - 0.5 - 0.25, 3.0]
    torch.testing.assert_close(out[0], torch.tensor(expected))
    torch.testing.assert_close(out[1], torch.tensor(raw))


@pytest.mark.parametrize("as_arrays", [False, True])
def test_penalties_match_a_per_token_reference(as_arrays: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    vocab, rows = 50, 6
    logits = torch.randn(rows, vocab, generator=gen) * 3
    params, prompts, outputs = [], [], []
    for i in range(rows):
        rep, freq, pres = [(1.3, 0.4, -0.3), (1.0, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, -0.5, 1.5)][
            i % 4
        ]
        params.append(sp(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres))
        prompts.append(torch.randint(0, vocab, (20,), generator=gen).tolist())
        outputs.append(torch.randint(-1, vocab + 3, (15,), generator=gen).tolist())
    if as_arrays:  # the model runner passes numpy views of its token buffer
        metadata = build(
            params,
            vocab,
            prompts=[np.asarray(p, dtype=np.int32) for p in prompts],
            outputs=[np.asarray(o, dtype=np.int32) for o in outputs],
        )
    else:
        metadata = build(params, vocab, prompts=prompts, outputs=outputs)
    out = apply_penalties(logits.clone(), metadata)
    expected = logits.clone()
    for i, p in enumerate(params):
        counted = [t for t in outputs[i] if 0 <= t < vocab]
        seen = set(prompts[i]) | set(counted)
        for t in range(vocab):
            value = float(expected[i, t])
            if t in seen:
                rep = p.repetition_penalty
                value = value / rep if value > 0 else value * rep
            value -= p.frequency_penalty * counted.count(t)
            value -= p.presence_penalty * (t in counted)
            expected[i, t] = value
    torch.testing.assert_close(out, expected)


def test_penalties_change_the_greedy_token_and_ignore_placeholders() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    params = [sp(temperature=0.0, frequency_penalty=1.0)]
    out = sample(params, logits, outputs=[[0, -1, 99]])
    assert out.sampled_token_ids.tolist() == [1]
    out = sample([sp(temperature=0.0, presence_penalty=0.6)], logits, outputs=[[0, 0, 0]])
    assert out.sampled_token_ids.tolist() == [1]
    out = sample([sp(temperature=0.0, repetition_penalty=1.5)], logits, prompts=[[0]])
    assert out.sampled_token_ids.tolist() == [1]  # 3 / 1.5 = 2 < 2.5


def test_logit_bias() -> None:
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 2)
    params = [sp(temperature=0.0, logit_bias={2: 5.0, 10: 100.0}), sp(temperature=0.0)]
    assert sample(params, logits).sampled_token_ids.tolist() == [2, 0]
    counts = draw_many(sp(logit_bias={0: -100.0}), PROBS, 5000)
    assert counts[0] == 0


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])
    params = [sp(temperature=0.0, min_tokens=2, stop_token_ids=[2])]
    short = sample(params, logits, outputs=[[0]], eos=[1])
    assert short.sampled_token_ids.tolist() == [3]
    done = sample(params, logits, outputs=[[0, 0]], eos=[1])
    assert done.sampled_token_ids.tolist() == [1]
    assert build(params, 5, outputs=[[0, 0]], eos=[1]).is_argmax_only
    # Masked even with ignore_eos (as vLLM), and a random row never draws a masked id.
    params = [sp(min_tokens=3, ignore_eos=True, stop_token_ids=[0])] * 3000
    logits = torch.tensor(PROBS).log().expand(3000, -1).contiguous()
    tokens = sample(params, logits, eos=[1] * 3000).sampled_token_ids
    assert not ((tokens == 0) | (tokens == 1)).any()


# ───────────────────────────── logprobs ─────────────────────────────


def test_logprobs_are_raw_with_top_k_and_ranks() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    params = [
        sp(temperature=0.0, logprobs=3),
        sp(temperature=0.7, logprobs=5, frequency_penalty=1.0),
        sp(temperature=0.0),
        sp(temperature=1.3, logprobs=0, top_k=10),
    ]
    out = sample(params, logits, outputs=[[1, 2], [int(logits[1].argmax())], [], []])
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.ranks is not None
    assert out.logprob_token_ids.shape == out.logprobs.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.long
    raw = logits.log_softmax(dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    for i in range(4):
        expected_rank = int((raw[i] > raw[i, sampled[i]]).sum()) + 1
        assert out.ranks[i] == expected_rank
    assert out.ranks[0] == 1 and out.ranks[2] == 1


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    out = sample([sp(logprobs=0), sp()], logits)
    assert out.logprobs is not None and out.logprobs.shape == (2, 1)


def test_compute_logprobs_rows() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(7))
    token_ids = torch.tensor([0, 3, 39, 7, 7])
    ids, logprobs, ranks = compute_logprobs_rows(logits, token_ids, 2)
    raw = logits.log_softmax(dim=-1)
    assert ids.shape == logprobs.shape == (5, 3)
    assert torch.equal(ids[:, 0], token_ids)
    torch.testing.assert_close(logprobs[:, 0], raw[torch.arange(5), token_ids])
    assert torch.equal(ranks, (raw >= raw[torch.arange(5), token_ids][:, None]).sum(-1))
    assert math.isclose(float(logprobs[0, 1]), float(raw[0].max()), rel_tol=1e-6)


# ───────────────────────────── metadata ─────────────────────────────


def test_metadata_builds_only_what_is_used() -> None:
    metadata = build([sp(temperature=0.8), sp(temperature=0.8, seed=3)], 10, outputs=[[], [1, 2]])
    assert metadata.all_random and not metadata.is_argmax_only
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties and metadata.logit_bias_index is None
    assert metadata.min_tokens_index is None and metadata.max_num_logprobs is None
    assert metadata.seeded_rows == (1,) and metadata.row_seeds == (step_seed(3, 2),)
    assert metadata.num_unseeded == 1 and metadata.unseeded_rows is not None
    metadata = build([sp(top_k=3), sp(top_k=7, top_p=0.5), sp(temperature=0.0, logprobs=2)], 10)
    assert metadata.max_top_k == 7 and metadata.max_num_logprobs == 2
    assert metadata.top_k is not None and metadata.top_k.tolist() == [3, 7, 10]
    assert metadata.greedy_mask is not None and metadata.greedy_mask.tolist() == [0, 0, 1]


def test_wrong_logits_shape_is_rejected() -> None:
    metadata = build([sp(temperature=0.5)], 10)
    with pytest.raises(ValueError, match="logits of shape"):
        Sampler()(torch.zeros(1, 12), metadata)
