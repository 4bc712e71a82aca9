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
from typing import TYPE_CHECKING

import numpy as np

from vx.messages import SAMPLE_FAILED, Logprobs

if TYPE_CHECKING:
    from vx.gpu.input_batch import InputBatch
    from vx.gpu.spec_decode.proposer import Proposer

__all__ = ["SAMPLE_FAILED", "accept_drafts", "num_accepted", "roll_back"]



def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts the samples confirm (`sampled` has len(drafts) + 1 entries:
    the request emits sampled[: num_accepted + 1])."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} samples for {len(drafts)} drafts")
    for j, d in enumerate(drafts):
        if sampled[j] != d:
            return j
    return len(drafts)


def accept_drafts(
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    spec: dict[str, list[int]],
    sample_idx: np.ndarray,
    sampled: np.ndarray,
    sampled_lists: list[list[int]],
    logprobs_out: list[Logprobs | None] | None,
    proposer: Proposer | None,
) -> None:
    """A step with drafts (`spec`, by request id): each sampling request's tokens are its
    accepted drafts, then its own sample; they go to `sampled_lists[i]` and join its known
    tokens in `batch`, and its Logprobs keep those positions. `sample_idx` repeats request i
    once per scored row, in order (`sampled` holds a token per row)."""
    tokens = np.maximum(sampled, 0).tolist()
    j = 0
    for i in np.unique(sample_idx).tolist():  # ascending, as the rows were expanded
        req_id, row = req_ids[i], int(rows[i])
        d = spec.get(req_id, ())
        mine = tokens[j : j + len(d) + 1]
        failed = min(sampled[j : j + len(d) + 1]) < 0
        j += len(d) + 1
        if failed:  # as a plain row: SAMPLE_FAILED, and a harmless token
            sampled_lists[i] = [SAMPLE_FAILED]
            batch.append_token_list(row, [0])
            continue
        a = num_accepted(d, mine) if d else 0
        out = mine[: a + 1]
        sampled_lists[i] = out
        batch.append_token_list(row, out)
        if d and proposer is not None:
            proposer.record(req_id, len(d), a)
        lp = None if logprobs_out is None else logprobs_out[i]
        if lp is not None and len(lp.ranks) > len(out):  # the emitted positions only
            n = len(out)
            logprobs_out[i] = Logprobs(  # type: ignore[index]
                token_ids=lp.token_ids[:n], logprobs=lp.logprobs[:n], ranks=lp.ranks[:n]
            )


def roll_back(
    num_drafts: np.ndarray,
    sampled_lists: list[list[int]],
    computed: np.ndarray,
) -> None:
    """A step with drafts: `computed[i]` (request i's computed count after the step, as
    scheduled) goes back by its rejected drafts. Its blocks past them, which held rejected
    drafts only, stay in its block table until the request is next scheduled: the scheduler
    frees them then, and the batch drops them by the same rule (`InputBatch.update`); a step
    scheduled before this one's output (async scheduling) still counts them."""
    for i, toks in enumerate(sampled_lists):
        rejected = int(num_drafts[i]) + 1 - len(toks) if toks else 0
        if rejected > 0:
            computed[i] -= rejected
