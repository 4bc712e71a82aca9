"""Prompt-lookup drafts: the tokens that followed the last time a request's latest n-gram
appeared in its own tokens (prompt and outputs).

Runs in: rank 0's Worker, after each step's sampling (`ModelRunner.execute`); the drafts go
back to the EngineCore with the step's output and are scheduled, and scored, in the next step.

Per request, the longest suffix of `max_n` down to `min_n` tokens that occurred before
proposes up to `k` tokens: those after its latest earlier occurrence (copying favours the
nearest source). The search looks only at the positions holding the suffix's last token, one
vectorised compare over the tokens, then the few candidates.

Adaptivity (`vx.gpu.spec_decode.proposer`): a request whose drafts keep failing stops drafting;
random text then costs only the search.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vx.gpu.spec_decode.proposer import MIN_ACCEPTANCE, PROBE_DRAFTS, Proposer

if TYPE_CHECKING:
    from vx.gpu.input_batch import InputBatch

__all__ = ["MIN_ACCEPTANCE", "PROBE_DRAFTS", "NgramProposer"]

class NgramProposer(Proposer):
    """Invariant: `propose` returns at most `k` tokens, each a copy of a token of the request,
    and nothing for a request that `retire`d or whose acceptance fell below MIN_ACCEPTANCE."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not (k >= 1 and 1 <= min_n <= max_n):
            raise ValueError(f"bad n-gram proposer settings k={k} n=[{min_n}, {max_n}]")
        super().__init__()
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, req_id: str, tokens: np.ndarray) -> list[int]:
        """Up to `k` drafts to follow `tokens` (the request's known tokens), or []."""
        if not self.may_draft(req_id):
            return []
        n_tokens = len(tokens)
        if n_tokens <= self.min_n:
            return []
        # earlier positions of the last token, latest first (never the last position itself)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        # each candidate's match length (up to max_n), one vectorised compare per length
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for i in range(1, self.max_n):
            alive &= ends >= i
            if not alive.any():
                break
            alive[alive] = tokens[ends[alive] - i] == tokens[n_tokens - 1 - i]
            length += alive
        best_n = int(length.max())
        if best_n < self.min_n:
            return []
        best_end = int(ends[np.flatnonzero(length == best_n)[-1]])  # the latest longest
        return tokens[best_end + 1 : best_end + 1 + self.k].tolist()

    def propose_batch(
        self,
        batch: InputBatch,
        req_ids: list[str],
        rows: np.ndarray,
        sampled: list[list[int]],
        num_computed: np.ndarray | None = None,
    ) -> dict[str, list[int]]:
        """Drafts for the next step of each request that sampled now (`sampled[i]`, request
        `req_ids[i]` at batch row `rows[i]`), by request id. None for a failed sample (a request
        with a grammar drafts too: each draft position is masked by the state it would reach,
        `GrammarMatchers.mask_logits`). `num_computed`
        (the step's computed counts before it) is the draft model's business."""
        out: dict[str, list[int]] = {}
        for i, toks in enumerate(sampled):
            if not toks or toks[0] < 0:
                continue
            row = int(rows[i])
            drafts = self.propose(req_ids[i], batch.token_ids[row, : int(batch.num_tokens[row])])
            if drafts:
                out[req_ids[i]] = drafts
        return out
