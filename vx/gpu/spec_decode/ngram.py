"""Prompt-lookup drafts: the tokens that followed the last time a request's latest n-gram
appeared in its own tokens (prompt and outputs).

Runs in: rank 0's Worker, after each step's sampling (`ModelRunner.execute`); the drafts go
back to the EngineCore with the step's output and are scheduled, and scored, in the next step.

Per request, the longest suffix of `max_n` down to `min_n` tokens that occurred before
proposes up to `k` tokens: those after its latest earlier occurrence (copying favours the
nearest source). The search looks only at the positions holding the suffix's last token, one
vectorised compare over the tokens, then the few candidates.

Adaptivity (`vx.gpu.spec_decode.draft_length`): each request scores as many of its drafts as
are likely to hold, judged by how its earlier proposals (scored or not) fared against the tokens
that came; a request whose drafts keep failing scores none, and random text then costs only the
search, until its proposals would hold again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vx.gpu.spec_decode.draft_length import DraftLength
from vx.gpu.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from vx.gpu.input_batch import InputBatch

__all__ = ["NgramProposer"]


class NgramProposer(Proposer):
    """Invariant: `lookup` returns at most `k` tokens, each a copy of a token of the request;
    `propose_batch` drafts at most `DraftLength.length` of them for a request, and answers
    (possibly with no drafts) exactly the sampled requests whose length is above zero."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not (k >= 1 and 1 <= min_n <= max_n):
            raise ValueError(f"bad n-gram proposer settings k={k} n=[{min_n}, {max_n}]")
        super().__init__()
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.lengths = DraftLength(k)

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Scored drafts teach nothing more than the tokens do (`DraftLength.observe`)."""

    def retire(self, req_id: str) -> None:
        self.lengths.retire(req_id)

    def lookup(self, tokens: np.ndarray) -> list[int]:
        """Up to `k` tokens to follow `tokens` (a request's known tokens), or []."""
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
        `req_ids[i]` at batch row `rows[i]`), by request id: every such request whose draft
        length is above zero, with the drafts it has (maybe none: no match now); none for a
        failed sample (a request with a grammar drafts too: each draft position is masked by
        the state it would reach, `GrammarMatchers.mask_logits`). `num_computed` (the step's
        computed counts before it) is the draft model's business."""
        out: dict[str, list[int]] = {}
        lengths = self.lengths
        token_ids, num_tokens = batch.token_ids, batch.num_tokens
        for i, toks in enumerate(sampled):
            if not toks or toks[0] < 0:
                continue
            req_id, row = req_ids[i], int(rows[i])
            n = int(num_tokens[row])
            known = token_ids[row]
            lengths.observe(req_id, known, n)
            length = lengths.length(req_id)
            if length == 0 and lengths.watching(req_id):
                continue  # nothing to draft, nor to learn from a new proposal yet
            proposal = self.lookup(known[:n])
            lengths.watch(req_id, n, proposal)
            if length:
                out[req_id] = proposal[:length]
        return out
