"""Draft verification keeps the target distribution (`vx.gpu.spec_decode.verifier` on the
sampler's own samples): for a one-hot draft q (n-gram drafts), accepting while the target's
sample equals the draft is exact rejection sampling, so the emitted tokens are distributed as
the target's. Checked over 10^5 draws of a 6-token vocabulary, with a bound that can fail:
total variation under 0.01 at each emitted position, and the acceptance rate p(d) within 0.01.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.gpu.sample.sampler import Sampler, SamplingMetadata
from vx.gpu.spec_decode.verifier import num_accepted
from vx.sampling_params import SamplingParams

N = 100_000
LOGITS = [[2.0, 1.2, 0.3, -0.5, 0.9, -1.0], [0.1, 1.5, -0.2, 0.8, 2.2, 0.0]]
DRAFT = [1, 4]  # one draft per position; the third row is the bonus position
BONUS = [0.5, 0.0, 1.0, -1.0, 0.3, 0.6]


def target(logits: list[float], params: SamplingParams) -> np.ndarray:
    """The sampler's distribution for one row: temperature, then top-p (greedy: one-hot)."""
    x = np.asarray(logits, dtype=np.float64)
    if params.temperature == 0:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    p = np.exp(x / params.temperature)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < params.top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams.create(temperature=0.0),
        SamplingParams.create(temperature=0.7),
        SamplingParams.create(temperature=1.0, top_p=0.8),
    ],
    ids=["greedy", "t0.7", "top-p"],
)
def test_emitted_tokens_follow_the_target_distribution(params: SamplingParams) -> None:
    rows = [*LOGITS, BONUS]
    logits = torch.tensor(rows, dtype=torch.float32).repeat(N, 1)
    md = SamplingMetadata.build(
        [params] * (3 * N), prompt_token_ids=[[]] * (3 * N), output_token_ids=[[]] * (3 * N),
        eos_token_ids=[None] * (3 * N), vocab_size=6, device=torch.device("cpu"),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1234)
    sampled = Sampler(generator=gen)(logits, md).sampled_token_ids.view(N, 3).numpy()
    first = np.zeros(6)
    second = np.zeros(6)
    accepted_first = 0
    for t in sampled.tolist():
        a = num_accepted(DRAFT, t)
        out = t[: a + 1]
        first[out[0]] += 1
        if a >= 1:
            accepted_first += 1
            second[out[1]] += 1
    p0, p1 = target(LOGITS[0], params), target(LOGITS[1], params)
    assert 0.5 * np.abs(first / N - p0).sum() < 0.01
    assert abs(accepted_first / N - p0[DRAFT[0]]) < 0.01
    if accepted_first > 1000:  # given draft 0 held, position 1 is the target's too
        assert 0.5 * np.abs(second / accepted_first - p1).sum() < 0.015
