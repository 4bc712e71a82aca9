"""What every draft proposer shares: the hooks of per-request adaptivity, and the draft
model's own rule (the n-gram proposer judges by its proposals' outcomes instead,
`vx.gpu.spec_decode.draft_length`).

Runs in: each Worker process (`ModelRunner.execute`), beside the proposer that owns it.

A request whose drafts keep failing stops drafting: after `PROBE_DRAFTS` drafts, one whose
acceptance is below `MIN_ACCEPTANCE` drafts no more (random text then costs only the
proposer's own work); each request is judged on its own, and afresh after a preemption.
"""

from __future__ import annotations

__all__ = ["MIN_ACCEPTANCE", "PROBE_DRAFTS", "Proposer"]

#: Drafts a request is judged on before its acceptance may stop it drafting.
PROBE_DRAFTS = 24
#: Below this share of accepted drafts (after PROBE_DRAFTS) a request stops drafting.
MIN_ACCEPTANCE = 0.2


class Proposer:
    """Invariant: `may_draft` is False for a request whose acceptance fell below
    MIN_ACCEPTANCE after PROBE_DRAFTS drafts, until it is `retire`d."""

    def __init__(self) -> None:
        self._drafted: dict[str, int] = {}
        self._accepted: dict[str, int] = {}

    def may_draft(self, req_id: str) -> bool:
        drafted = self._drafted.get(req_id, 0)
        return drafted < PROBE_DRAFTS or self._accepted.get(req_id, 0) >= MIN_ACCEPTANCE * drafted

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A request's verified step: `num_accepted` of its `num_drafts` drafts held."""
        self._drafted[req_id] = self._drafted.get(req_id, 0) + num_drafts
        self._accepted[req_id] = self._accepted.get(req_id, 0) + num_accepted

    def retire(self, req_id: str) -> None:
        """Forget a request (finished, or preempted: it is judged afresh when it resumes)."""
        self._drafted.pop(req_id, None)
        self._accepted.pop(req_id, None)
