"""Async scheduling's draft slots on the Worker's side: the slots take the Worker's own drafts
(`DraftSlots`), and the batch keeps its own computed count and drops rejected drafts' blocks
by the scheduler's rule (`InputBatch.update`)."""

from __future__ import annotations

from vx.config import BLOCK_SIZE
from vx.gpu.input_batch import InputBatch
from vx.gpu.spec_decode.slots import DraftSlots
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams


def _step(nst: dict[str, int], spec: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(
        7, [], CachedRequestData(list(nst), [[] for _ in nst], [0] * len(nst)), nst,
        sum(nst.values()), [], [], spec,
    )  # fmt: skip


def test_slots_take_the_workers_latest_drafts_and_shrink_where_it_has_fewer() -> None:
    slots = DraftSlots()
    slots.keep(["a", "b", "c"], [[5], [6], []], {"a": [1, 2, 3, 4], "b": [9]})
    slots.keep(["b"], [[7]], {})  # b sampled again without drafts: its old ones go
    assert slots.drafts == {"a": [1, 2, 3, 4]}
    so, scored = slots.fill(_step({"a": 4, "b": 4, "d": 1}, {"a": [-1] * 3, "b": [-1] * 3}))
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert so.num_scheduled_tokens == {"a": 4, "b": 1, "d": 1}
    assert so.total_num_scheduled_tokens == 6 and scored == {"a": 3, "b": 0}
    slots.drop("a")
    assert slots.drafts == {}


def test_batch_keeps_its_own_count_and_drops_rejected_drafts_blocks() -> None:
    assert BLOCK_SIZE == 16
    batch = InputBatch(4, 256, 16, speculative=True)
    params = SamplingParams.create(max_tokens=8)
    batch.add(NewRequestData("a", list(range(30)), params, [3, 4], 30))
    # step m scores position 30 and four drafts (a third block, 5): all rejected, 31 computed
    batch.update(CachedRequestData(["a"], [[5]], [30]))
    batch.num_computed_tokens[0] = 31
    # step m + 1 was scheduled as if all held (35 sent): our count holds, no block goes
    batch.update(CachedRequestData(["a"], [[]], [35]))
    assert batch.num_computed_tokens[0] == 31 and batch.num_blocks[0] == 3
    batch.num_computed_tokens[0] = 32
    # step m + 2: the scheduler heard of the rejections, freed block 5, holds 6 next
    batch.update(CachedRequestData(["a"], [[6]], [32]))
    assert batch.block_table[0, : batch.num_blocks[0]].tolist() == [3, 4, 6]
    assert batch.num_computed_tokens[0] == 32
