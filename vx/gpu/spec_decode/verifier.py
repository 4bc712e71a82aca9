"""Which drafts hold: a drafting request's 1 + k scored positions, sampled as if each were
its own step, against its k drafts.

Runs in: each Worker process (`ModelRunner.execute`, rank 0's result is the step's).

The target samples position j (after the known tokens and drafts[:j]) with the sampler's own
rules: the same processors on p, the same noise (a seeded request's is keyed by its output
position, `vx.gpu.sample.metadata.step_seed`), so t_j is what the step without speculation
would sample there. Drafts are accepted while t_j == drafts[j]; the first t_j that differs, or
t_k after k accepted drafts, is the request's own token. For a greedy row this is the longest
matching prefix. For a sampled row and a draft distribution q that is one-hot (n-gram drafts),
it is exact rejection sampling: the draft d is kept with probability p(d) = min(1, p(d)/q(d)),
and when it is not, t_j is distributed as p without d, renormalised: norm(max(0, p - q)).
So the output is distributed as the target's, and with a seed it is the very sequence the
request gets without speculation (given the same logits).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["num_accepted"]


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts the samples confirm (`sampled` has len(drafts) + 1 entries:
    the request emits sampled[: num_accepted + 1])."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} samples for {len(drafts)} drafts")
    for j, d in enumerate(drafts):
        if sampled[j] != d:
            return j
    return len(drafts)
