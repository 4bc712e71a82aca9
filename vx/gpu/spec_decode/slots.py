"""Draft slots: speculative decoding under async scheduling, where the Worker holds the drafts.

Runs in: each Worker process (`ModelRunner.execute`), every rank alike.

With async scheduling the EngineCore schedules step n + 1 before step n's output comes back,
so it cannot know the drafts proposed after step n (nor how many of step n's drafts hold).
It schedules slots instead (vLLM V1's way): each drafting request gets up to
`num_speculative_tokens` draft positions of value -1 in `scheduled_spec_decode_tokens`, and
counts them as accepted until the output says otherwise. Every rank proposes after each step
(deterministically, from the same tokens) and keeps each request's latest drafts here; the next
step's slots take them, and a request with fewer drafts than slots scores fewer positions. The
output tells the scheduler how many each scored (`ModelRunnerOutput.spec_num_scored`).
"""

from __future__ import annotations

import msgspec

from vx.messages import SchedulerOutput

__all__ = ["DraftSlots"]


class DraftSlots:
    """Invariant: `drafts[r]` are the drafts proposed after request r's latest sampled step,
    for its next one; a request that sampled without drafts, finished or was preempted has
    none."""

    def __init__(self) -> None:
        self.drafts: dict[str, list[int]] = {}

    def keep(
        self, req_ids: list[str], sampled: list[list[int]], drafts: dict[str, list[int]]
    ) -> None:
        """After a step: the drafts (by request id) of the requests that sampled in it."""
        mine = self.drafts
        for req_id, toks in zip(req_ids, sampled, strict=True):
            if toks:
                d = drafts.get(req_id)
                if d:
                    mine[req_id] = d
                else:
                    mine.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        self.drafts.pop(req_id, None)

    def fill(self, so: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, int]]:
        """The step with its draft slots filled, each request's tokens cut by the slots it
        cannot fill; and how many drafts each drafting request scores."""
        nst = dict(so.num_scheduled_tokens)
        total = so.total_num_scheduled_tokens
        filled: dict[str, list[int]] = {}
        num_scored: dict[str, int] = {}
        for req_id, slots in so.scheduled_spec_decode_tokens.items():
            mine = self.drafts.get(req_id, [])[: len(slots)]
            if mine:
                filled[req_id] = mine
            num_scored[req_id] = len(mine)
            cut = len(slots) - len(mine)
            if cut:
                nst[req_id] -= cut
                total -= cut
        so = msgspec.structs.replace(
            so, num_scheduled_tokens=nst, total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=filled,
        )  # fmt: skip
        return so, num_scored
