"""How many of its drafts a request scores next: per-request acceptance by draft position,
learnt from every proposal, scored or not.

Runs in: each Worker process, inside the n-gram proposer (`vx.gpu.spec_decode.ngram`).

A draft is worth a verification row only while it is likely to hold. The proposer keeps one
proposal of each request under watch (its full `k` tokens, whatever part of it was scored) and,
once the request's known tokens settle it (a token that differs, or all `k` matched), counts
for each position j whether the proposal held through j. The known tokens are the target's own
samples, with or without drafts (a draft is accepted exactly when the emitted token equals it),
so a request that scores no drafts still learns what its drafts would have done, and starts
drafting again when they would hold. Counts decay (`DECAY` a settled proposal), so the estimate
follows the text: a code copy after a novel preamble, a count after a copied header.

The length: the most positions j whose estimated chance of holding through j (the product of
the per-position rates, each with a prior of `PRIOR` worth `PRIOR_WEIGHT` proposals) is at
least `MIN_WORTH`. A row costs a fraction of a step (0.25 ms of a ~20 ms step at c = 8 on a
2-core CPU, 0.75 of 10 ms at c = 1) and an accepted draft saves a token's share of a step; at
`MIN_WORTH` a draft pays for its row at those figures with room to spare. A request whose
drafts keep failing thus scores none (random text costs only the proposer's search), judged
on its own, and afresh after a preemption.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DECAY", "MIN_WORTH", "PRIOR", "PRIOR_WEIGHT", "DraftLength"]

#: A draft position is scored while its estimated chance of holding is at least this.
MIN_WORTH = 0.2
#: Each settled proposal scales the earlier counts by this (about the last 10 count).
DECAY = 0.9
#: The per-position acceptance a request starts from, worth PRIOR_WEIGHT proposals.
PRIOR = 0.7
PRIOR_WEIGHT = 2.0


class _Stats:
    __slots__ = ("tried", "held", "start", "proposal", "length")

    def __init__(self, k: int) -> None:
        self.tried = [0.0] * k  # proposals that reached position j (decayed)
        self.held = [0.0] * k  # ... and held at j
        self.start = 0  # the known-token count when `proposal` was made
        self.proposal: list[int] | None = None
        self.length = k


class DraftLength:
    """Invariant: `length(r)` is in [0, k]; it is k for a request never seen, and changes only
    when a watched proposal of that request is settled by its known tokens (`observe`)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._stats: dict[str, _Stats] = {}
        self._initial = self._length([0.0] * k, [0.0] * k)

    def length(self, req_id: str) -> int:
        s = self._stats.get(req_id)
        return self._initial if s is None else s.length

    def watching(self, req_id: str) -> bool:
        """Whether a proposal of the request waits to be settled (a new one is not watched)."""
        s = self._stats.get(req_id)
        return s is not None and s.proposal is not None

    def watch(self, req_id: str, start: int, proposal: list[int]) -> None:
        """A proposal made when the request had `start` known tokens; ignored while another
        is watched, or when empty."""
        if not proposal:
            return
        s = self._stats.get(req_id)
        if s is None:
            s = self._stats[req_id] = _Stats(self.k)
            s.length = self._initial
        if s.proposal is None:
            s.start, s.proposal = start, proposal[: self.k]

    def observe(self, req_id: str, tokens: np.ndarray, num_tokens: int) -> None:
        """Settle the watched proposal, if the known tokens (`tokens[:num_tokens]`) do."""
        s = self._stats.get(req_id)
        if s is None or s.proposal is None:
            return
        prop, start = s.proposal, s.start
        n = len(prop)
        lim = min(num_tokens - start, n)
        if lim <= 0:
            return
        seen = tokens[start : start + lim].tolist()
        m = 0
        while m < lim and seen[m] == prop[m]:
            m += 1
        if m == lim and m < n:
            return  # all matched so far, more to come
        tried, held = s.tried, s.held
        for j in range(self.k):
            tried[j] *= DECAY
            held[j] *= DECAY
        for j in range(min(m + 1, n)):
            tried[j] += 1.0
        for j in range(m):
            held[j] += 1.0
        s.proposal = None
        s.length = self._length(tried, held)

    def retire(self, req_id: str) -> None:
        """Forget a request (finished, or preempted: judged afresh when it resumes)."""
        self._stats.pop(req_id, None)

    def _length(self, tried: list[float], held: list[float]) -> int:
        p = 1.0
        for j in range(self.k):
            p *= (held[j] + PRIOR * PRIOR_WEIGHT) / (tried[j] + PRIOR_WEIGHT)
            if p < MIN_WORTH:
                return j
        return self.k
