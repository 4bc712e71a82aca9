"""The KV self-check (audit the block pool against the Scheduler's requests), and the
per-request failure path.

Runs in: EngineCore. `kv_self_check` runs on demand (the `kv_self_check` utility call, and tests
after every step); it walks every block and request, O(num_blocks + tokens held), so it is never
on the step path. `fail_requests` runs only when a request's own update raised.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from vx.core.request import RequestStatus
from vx.messages import EngineCoreOutput, FinishReason

if TYPE_CHECKING:
    from vx.core.request import Request
    from vx.core.scheduler import Scheduler

__all__ = ["fail_requests", "kv_self_check"]

logger = logging.getLogger(__name__)


def fail_requests(
    scheduler: Scheduler, failed: list[tuple[Request, Exception]]
) -> list[EngineCoreOutput]:
    """Finish each request whose own update raised with finish_reason "error", freeing its
    blocks; the other requests of the step are untouched and the engine goes on."""
    outputs = []
    for request, e in failed:
        logger.error("request %s failed in its update: %r", request.request_id, e)
        if request.request_id in scheduler.requests:
            scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        outputs.append(
            EngineCoreOutput(
                request.request_id, [], FinishReason.ERROR, error=f"{type(e).__name__}: {e}"
            )
        )
    return outputs


def kv_self_check(scheduler: Scheduler) -> dict[str, object]:
    """Return ``{"ok", "idle", "problems", ...counts}``; `problems` is empty when sound.

    Always: the pool's own invariants; every block's ref_cnt equals the number of live
    requests holding it (no referenced block without an owner, no owner without a reference);
    queue membership matches status; a running request holds blocks for its computed tokens.
    When idle (no requests): additionally every block is free (free + cached == total).
    """
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    problems = list(pool.check_invariants())
    owners: collections.Counter[int] = collections.Counter()
    for request_id, blocks in kv.req_to_blocks.items():
        if request_id not in scheduler.requests:
            problems.append(f"blocks held by unknown request {request_id!r}")
        for block in blocks:
            owners[block.block_id] += 1
    for block in pool.blocks:
        if block.ref_cnt != owners[block.block_id]:
            problems.append(
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"{owners[block.block_id]} owning requests"
            )
    running_ids = {r.request_id for r in scheduler.running}
    waiting_ids = {r.request_id for r in scheduler.waiting}
    if len(running_ids) != len(scheduler.running) or len(waiting_ids) != len(scheduler.waiting):
        problems.append("a request is queued twice")
    if running_ids & waiting_ids:
        problems.append(f"requests both running and waiting: {sorted(running_ids & waiting_ids)}")
    if running_ids | waiting_ids != set(scheduler.requests):
        problems.append("the queues and the request table disagree")
    if len(running_ids) > scheduler.max_num_seqs:
        problems.append(f"{len(running_ids)} running requests exceed max_num_seqs")
    block_size = kv.block_size
    for request in scheduler.running:
        held = len(kv.req_to_blocks.get(request.request_id, ()))
        if request.status != RequestStatus.RUNNING:
            problems.append(f"{request} is in running with status {request.status.name}")
        if held * block_size < request.num_computed_tokens:
            problems.append(f"{request} holds {held} blocks for its computed tokens")
        if request.num_tokens > request.max_num_tokens:
            problems.append(f"{request} is past its length limit {request.max_num_tokens}")
    for request in scheduler.waiting:
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            problems.append(f"{request} is in waiting with status {request.status.name}")
        if request.request_id in kv.req_to_blocks or request.num_computed_tokens:
            problems.append(f"waiting {request} holds blocks or computed tokens")
    stats = pool.statistics()
    idle = not scheduler.requests
    if idle and stats.num_free_blocks != stats.num_blocks:
        problems.append(
            f"idle, but only {stats.num_free_blocks} of {stats.num_blocks} blocks are free"
        )
    return {
        "ok": not problems,
        "idle": idle,
        "problems": problems,
        "num_blocks": stats.num_blocks,
        "num_free_blocks": stats.num_free_blocks,
        "num_cached_free_blocks": stats.num_cached_free_blocks,
        "num_cached_blocks": stats.num_cached_blocks,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
    }
