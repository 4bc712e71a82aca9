"""The Scheduler: which requests run in the next step, and with how many tokens each.

Runs in: EngineCore. Synchronous, torch-free, I/O-free: the EngineCore loop feeds it
`AddRequest`s and aborts, calls `schedule()` to get a `SchedulerOutput` for the workers, and
`update_from_output()` with rank 0's `ModelRunnerOutput` to get the `EngineCoreOutput`s.

The one rule (vLLM V1): there is no prefill or decode phase. Each request has
`num_computed_tokens` and `num_tokens` (prompt + known outputs + placeholders), and each step
hands every request, running ones first and then waiting ones, as many tokens as close the gap,
under `max_num_batched_tokens` and `max_num_seqs`. Chunked prefill, prefix-cache hits and
resumption after preemption all fall out of that rule.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections import deque
from collections.abc import Iterable

from vx.config import EngineConfig
from vx.core.block_hash import update_block_hashes
from vx.core.hybrid_kv_cache_manager import HybridKVCacheManager
from vx.core.kv_cache_manager import KVCacheManager
from vx.core.request import Request, RequestStatus
from vx.log import request_extra
from vx.messages import (
    AddRequest,
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
#: A draft slot (async scheduling): the Worker puts its own draft there, or scores none.
_DRAFT_SLOT = -1
_NONES = itertools.repeat(None)
_FINISHED = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
}


def _trim_logprobs(logprobs: Logprobs, n: int) -> Logprobs:
    return Logprobs(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])


class Scheduler:
    """FCFS scheduler with chunked prefill, prefix caching, recompute preemption and async
    scheduling (one step ahead, with output placeholders).

    Invariants:
    - every request in `requests` is in exactly one of `waiting` (WAITING or PREEMPTED, no
      blocks) or `running` (RUNNING, holds blocks for its computed tokens);
    - a step never schedules more than `max_num_batched_tokens` tokens (where set, while
      fewer than `small_step_running` run: `small_step_tokens` if fewer are held, running or
      waiting, else `burst_step_tokens`, draft tokens not counted), `running` never holds
      more than `max_num_seqs` requests, and no request ever grows past `max_model_len`;
    - every ending (stop, length, abort, error) goes through `_free_request`, which frees the
      blocks at once and queues the id for the next output's `finished_req_ids`;
    - the preemption victim is always the tail of `running`; it goes to the front of `waiting`,
      and nothing is admitted in a step that preempted;
    - with `batch_invariant`, no step's tokens of a request cross its prompt's end, and past it
      a request takes one token a step (`_invariant_cap`);
    - speculative decoding: a running request scheduled again holds exactly the blocks of its
      computed tokens before its new ones (`free_past`), the Worker's block table too; with
      async scheduling a step in flight counts all its drafts as computed and placed until
      its output, which takes back the rejected ones (`_count_accepted`).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        *,
        max_model_len: int | None = None,
        sliding_window: int | None = None,
        group_windows: list[int | None] | None = None,
    ) -> None:
        sched = config.scheduler
        self.config = config
        self.block_size = config.cache.block_size
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.small_step_tokens = sched.small_step_tokens
        self.small_step_running = sched.small_step_running
        self.burst_step_tokens = sched.burst_step_tokens
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        #: Pipeline parallel (vLLM V1's PP): the first stage cannot embed a token the last
        #: stage has not sampled yet, so a request is not scheduled again while a step of it
        #: is in flight (no output placeholders); the EngineCore's batch queue keeps
        #: `pp_size` steps of different requests in flight instead, each of at most
        #: 1/pp_size of the runnable requests (`_step_req_cap`), and the tokens the workers
        #: of the earlier stages have not sampled travel in `CachedRequestData.new_token_ids`.
        self.pp_size = config.parallel.pipeline_parallel_size
        self.async_scheduling = sched.async_scheduling and self.pp_size == 1
        #: `--batch-invariant`: a step's tokens of a request stay on one side of its prompt's
        #: end, and past it come one a step (`_invariant_cap`).
        self.batch_invariant = config.batch_invariant
        #: Speculative decoding: drafts scored and accepted, in total and by draft position.
        self.speculative = config.speculative.enabled
        k = config.speculative.num_speculative_tokens if self.speculative else 0
        #: The draft slots a drafting request gets a step under async scheduling, where the
        #: Worker fills them with the drafts it proposed after the step in flight (this process
        #: has not seen them yet) and scores fewer if it has fewer.
        self.num_spec_tokens = k
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        self.num_accepted_by_position = [0] * k
        self.enable_caching = config.cache.enable_prefix_caching
        # KV events name the pool's memory: "GPU" on cuda (vLLM's word), "CPU" on the CPU device.
        medium = ("GPU" if config.device == "cuda" else "CPU") if config.kv_events.enabled else None
        #: `sliding_window`: every layer's window (the Worker's report), or None; the KV
        #: manager frees the blocks that slide out of it (one pool, one budget still).
        #: `group_windows` (two or more KV-cache groups, the Worker's report): a table per
        #: group, each windowed group freeing what left its window; one pool, one budget.
        self.kv_cache_manager: KVCacheManager
        if group_windows and len(group_windows) > 1:
            self.kv_cache_manager = HybridKVCacheManager(
                num_blocks, group_windows, self.block_size, self.enable_caching,
                kv_events_medium=medium,
            )  # fmt: skip
        else:
            self.kv_cache_manager = KVCacheManager(
                num_blocks, self.block_size, self.enable_caching, kv_events_medium=medium,
                sliding_window=sliding_window,
            )  # fmt: skip
        capacity = self.kv_cache_manager.max_tokens_alone(self.max_num_batched_tokens)
        limit = max_model_len or config.model.max_model_len or capacity
        if limit > capacity:
            # A request alone must always fit, or it would preempt itself forever.
            logger.warning(
                "max_model_len %d exceeds the KV pool (%d tokens); capping it", limit, capacity
            )
            limit = capacity
        #: The context limit actually enforced (report this one in EngineReady).
        self.max_model_len = limit
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Requests held here (waiting or running) whose output follows a grammar: the
        #: dashboard's count (the Workers mask their logits; the scheduler treats them alike).
        self.num_constrained = 0
        # Freed / preempted since the last output that scheduled anything (see schedule()).
        self.finished_req_ids: list[str] = []
        self.preempted_req_ids: list[str] = []
        self._step_ids = itertools.count()
        self.num_preempted_total = 0
        self._last_num_prefill_tokens = 0
        self._last_num_decode_tokens = 0

    # ── requests in and out ─────────────────────────────────────────────────────────────
    def add_request(self, msg: AddRequest | Request) -> None:
        """Queue a request. Raises ValueError for a duplicate id or a prompt that can never run."""
        request = (
            msg
            if isinstance(msg, Request)
            else Request.from_add_request(msg, max_model_len=self.max_model_len)
        )
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if self.enable_caching:
            update_block_hashes(request, self.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.sampling_params.structured_outputs is not None:
            self.num_constrained += 1

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[str]:
        """End requests from outside (abort, error); frees their blocks at once. Idempotent:
        unknown or already finished ids are ignored. Returns the ids actually finished."""
        assert RequestStatus.is_finished(status), status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        unique_ids = dict.fromkeys(request_ids)
        victims = [r for rid in unique_ids if (r := self.requests.get(rid)) is not None]
        if not victims:
            return []
        gone = set(victims)
        if any(r.status == _RUNNING for r in victims):
            self.running = [r for r in self.running if r not in gone]
        if any(r.status != _RUNNING for r in victims):
            self.waiting = deque(r for r in self.waiting if r not in gone)
        for request in victims:
            self._free_request(request, status)
        return [r.request_id for r in victims]

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        """The one funnel every ending goes through (the caller removes it from its queue)."""
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)
        if request.sampling_params.structured_outputs is not None:
            self.num_constrained -= 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ── schedule ────────────────────────────────────────────────────────────────────────
    def schedule(self) -> SchedulerOutput:
        """Build the next step: running requests first, then admissions from `waiting`."""
        step_id = next(self._step_ids)
        budget = self.max_num_batched_tokens
        if self.small_step_tokens and len(self.running) < self.small_step_running:
            # Few running: small steps, unless a burst waits (as many held as
            # small_step_running): then burst steps, so it is all running sooner.
            if len(self.running) + len(self.waiting) < self.small_step_running:
                budget = min(budget, self.small_step_tokens)
            elif self.burst_step_tokens:
                budget = min(budget, self.burst_step_tokens)
        step_budget = budget
        #: what a small or burst step may add for drafts: they do not count against its cap
        #: (it bounds a step's prompt work; drafts taking it delayed every waiting prompt)
        draft_headroom = self.max_num_batched_tokens - budget
        threshold = self.long_prefill_token_threshold
        is_async = self.async_scheduling
        allocate_slots = self.kv_cache_manager.allocate_slots
        num_scheduled_tokens: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        cached_ids: list[str] = []
        cached_new_block_ids: list[list[int]] = []
        cached_num_computed: list[int] = []
        add_id, add_block_ids = cached_ids.append, cached_new_block_ids.append
        add_num_computed = cached_num_computed.append
        cached_new_tokens: list[list[int]] = []
        pp = self.pp_size > 1
        cap = self._step_req_cap() if pp else 0
        num_prefill_tokens = 0
        preempted = False

        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            if pp and len(num_scheduled_tokens) >= cap:
                break
            request = running[i]
            num_known = request.num_tokens + request.num_output_placeholders
            num_computed = request.num_computed_tokens
            num_new = num_known - num_computed
            if num_new > budget:
                num_new = budget
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = (_invariant_cap if self.batch_invariant else _prompt_end_cap)(
                request, num_computed, num_new
            )
            drafts = request.spec_token_ids
            if drafts or (is_async and request.drafting):
                request.spec_token_ids = []
                # Scored after its last known token: within the budget, and never past the
                # tokens it may still emit (each accepted draft is one, plus its own).
                if num_computed + num_new == num_known:
                    room = min(
                        budget + draft_headroom - num_new,
                        request.max_num_tokens - num_known - 1,
                    )
                    if is_async:  # slots: the Worker holds the drafts (`_DRAFT_SLOT`)
                        drafts = [_DRAFT_SLOT] * self.num_spec_tokens
                    drafts = drafts[: max(room, 0)]
                    if draft_headroom:
                        extra = min(len(drafts), draft_headroom)
                        draft_headroom -= extra
                        budget += extra
                        step_budget += extra
                    num_new += len(drafts)
                else:
                    drafts = []
            # Skip (not stop) when nothing is left to compute, or when the in-flight step's
            # tokens already take the request to its length limit (async scheduling).
            if num_new <= 0 or num_known >= request.max_num_tokens:
                i += 1
                continue
            if self.speculative:
                # Blocks past its computed tokens held rejected drafts only; the Worker drops
                # them by the same rule from the computed count this step sends
                # (`InputBatch.update`), before appending the new ones.
                self.kv_cache_manager.free_past(request, num_computed)
            new_block_ids = allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # the request preempted itself: nobody after it is left either
            request_id = request.request_id
            num_scheduled_tokens[request_id] = num_new
            if drafts:
                spec_tokens[request_id] = drafts
            add_id(request_id)
            add_block_ids(new_block_ids)
            add_num_computed(num_computed)
            if pp:  # the known tokens past the prompt that this step reads
                start = max(num_computed, request.num_prompt_tokens)
                cached_new_tokens.append(request.all_token_ids[start : num_computed + num_new])
            if num_computed < request.num_prompt_tokens:
                num_prefill_tokens += min(num_new, request.num_prompt_tokens - num_computed)
            num_computed += num_new
            request.num_computed_tokens = num_computed
            if is_async and num_computed == num_known + len(drafts):
                # A placeholder for its own token and one for each draft: every draft counts
                # as accepted until the step's output says how many were.
                request.num_output_placeholders += 1 + len(drafts)
                request.num_draft_slots += len(drafts)
            budget -= num_new
            i += 1

        new_reqs: list[NewRequestData] = []
        if not preempted:
            budget, num_prefill_tokens = self._admit_waiting(
                step_id, budget, num_scheduled_tokens, new_reqs, num_prefill_tokens, cap
            )

        total = step_budget - budget
        output = SchedulerOutput(
            step_id,
            new_reqs,
            CachedRequestData(
                cached_ids, cached_new_block_ids, cached_num_computed, cached_new_tokens
            ),
            num_scheduled_tokens,
            total,
            self.finished_req_ids,
            self.preempted_req_ids,
            spec_tokens,
        )
        # An output that schedules nothing may never be sent (the EngineCore drops it), so its
        # ids stay pending and ride along again; workers ignore ids they do not hold.
        if total:
            self.finished_req_ids = []
            self.preempted_req_ids = []
        self._last_num_prefill_tokens = num_prefill_tokens
        self._last_num_decode_tokens = total - num_prefill_tokens
        return output

    def _admit_waiting(
        self,
        step_id: int,
        budget: int,
        num_scheduled_tokens: dict[str, int],
        new_reqs: list[NewRequestData],
        num_prefill_tokens: int,
        cap: int = 0,
    ) -> tuple[int, int]:
        kv = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            if cap and len(num_scheduled_tokens) >= cap:
                break
            request = waiting[0]
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = (_invariant_cap if self.batch_invariant else _prompt_end_cap)(
                request, num_hit, num_new
            )
            if (
                kv.allocate_slots(
                    request, num_new, num_hit, hit_blocks, full_sequence_must_fit=True
                )
                is None
            ):
                break
            waiting.popleft()
            running.append(request)
            request.status = _RUNNING
            request.admitted_step_id = step_id
            if not request.num_preemptions:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit + num_new
            if self.async_scheduling and request.num_computed_tokens == request.num_tokens:
                request.num_output_placeholders = 1
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    kv.get_block_ids(request.request_id),
                    num_hit,
                    request.output_token_ids if request.num_preemptions else [],
                    request.eos_token_id,
                )
            )
            num_scheduled_tokens[request.request_id] = num_new
            num_prefill_tokens += num_new
            budget -= num_new
        return budget, num_prefill_tokens

    def _step_req_cap(self) -> int:
        """Pipeline parallel: the most requests one step takes, 1/pp_size of those that can
        run (held, up to max_num_seqs), so that the steps in flight split them evenly."""
        held = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        return max(1, -(-held // self.pp_size))

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, forget progress, resume first."""
        self.kv_cache_manager.free(request)
        logger.debug(
            "preempted %s, losing %d computed tokens", request, request.num_computed_tokens
        )
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.drafting = False
        # Tokens of steps still in flight will be dropped (status check in update_from_output).
        request.num_output_placeholders = 0
        request.num_draft_slots = 0
        request.num_preemptions += 1
        self.num_preempted_total += 1
        self.waiting.appendleft(request)
        self.preempted_req_ids.append(request.request_id)

    # ── update ──────────────────────────────────────────────────────────────────────────
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens; returns an output per request that gained tokens
        or finished. Tokens for requests finished, aborted or preempted since that step was
        scheduled are dropped."""
        step_id = scheduler_output.step_id
        requests = self.requests
        is_async = self.async_scheduling
        caching = self.enable_caching
        block_size = self.block_size
        prompt_logprobs = model_runner_output.prompt_logprobs
        logprobs = model_runner_output.logprobs
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        new_drafts = model_runner_output.spec_token_ids
        num_scored = model_runner_output.spec_num_scored
        outputs: list[EngineCoreOutput] = []
        emit = outputs.append
        make_output = EngineCoreOutput
        running_status = _RUNNING
        stopped: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        for request_id, token_ids, new_logprobs in zip(
            model_runner_output.req_ids,
            model_runner_output.sampled_token_ids,
            itertools.repeat(None) if logprobs is None else itertools.chain(logprobs, _NONES),
            strict=False,
        ):
            request = requests.get(request_id)
            if (
                request is None
                or request.status != running_status
                or step_id < request.admitted_step_id
            ):
                continue
            # A failure in one request's update fails that request alone (vLLM #17248).
            try:
                plp = None if prompt_logprobs is None else prompt_logprobs.get(request_id)
                if not token_ids:
                    if plp is not None:  # a prefill chunk's prompt logprobs
                        outputs.append(
                            EngineCoreOutput(
                                request_id, [], None, None, None, plp, request.num_cached_tokens
                            )
                        )
                    continue
                num_placed = len(token_ids)
                if scheduled_drafts:
                    drafts = scheduled_drafts.get(request_id)
                    if drafts:  # its accepted drafts, then its own token
                        num_placed = len(drafts) + 1
                        scored = len(drafts) if num_scored is None else num_scored.get(request_id, 0)
                        self._count_accepted(request, len(drafts), scored, len(token_ids) - 1)
                        if is_async:
                            n = request.num_draft_slots - len(drafts)
                            request.num_draft_slots = n if n > 0 else 0
                if is_async:
                    n = request.num_output_placeholders - num_placed
                    request.num_output_placeholders = n if n > 0 else 0
                finish_reason = stop_reason = None
                if len(token_ids) == 1:
                    # Hot path: one token (plain decode), no trimming possible.
                    token_id = token_ids[0]
                    if token_id < 0:  # the worker's sampling failed for this request
                        raise RuntimeError("sampling failed in the worker")
                    request.all_token_ids.append(token_id)
                    num_tokens = request.num_tokens = request.num_tokens + 1
                    if caching and num_tokens % block_size == 0:
                        self._cache_new_full_block(request)
                    if token_id in request.stop_token_set or num_tokens >= request.max_num_tokens:
                        finish_reason, stop_reason = request.check_stop(token_id)
                else:  # several tokens in one step (speculative): trim after the first stop
                    if min(token_ids) < 0:
                        raise RuntimeError("sampling failed in the worker")
                    n, finish_reason, stop_reason = request.append_output_token_ids(token_ids)
                    if caching:
                        self._cache_new_full_block(request)
                    if n < len(token_ids):
                        token_ids = token_ids[:n]
                        new_logprobs = new_logprobs and _trim_logprobs(new_logprobs, n)
            except Exception as e:
                failed.append((request, e))
                continue
            num_cached = request.num_cached_tokens
            emit(
                make_output(
                    request_id, token_ids, finish_reason, stop_reason, new_logprobs, plp, num_cached
                )
            )
            if finish_reason is not None:
                stopped.append(request)
                self._free_request(request, _FINISHED[finish_reason])
            elif new_drafts is not None:
                proposed = new_drafts.get(request_id)
                request.spec_token_ids = proposed or []
                # Async scheduling: a drafting request's next steps get slots (filled with the
                # Worker's newest drafts, `DraftSlots`), even where it had no drafts just now;
                # a slot per step would otherwise wait for an output one step old.
                request.drafting = proposed is not None
        if stopped:
            gone = set(stopped)
            self.running = [r for r in self.running if r not in gone]
        if failed:
            outputs += self._fail_requests(failed)
        return outputs

    def _count_accepted(
        self, request: Request, num_slots: int, num_drafts: int, num_accepted: int
    ) -> None:
        """A drafting request's step, scheduled with `num_slots` drafts, came back with
        `num_accepted` of the `num_drafts` it scored (fewer than its slots where the Worker
        had fewer drafts, async scheduling): the positions past the accepted ones were
        computed for nothing, or not at all, so its computed count goes back by them. The
        blocks past it held rejected drafts only: they go back to the pool when it is next
        scheduled (`schedule`), where the Worker drops them too."""
        if not 0 <= num_accepted <= num_drafts <= num_slots:
            raise RuntimeError(f"{num_accepted} accepted of {num_drafts} drafts, {num_slots} slots")
        request.num_computed_tokens -= num_slots - num_accepted
        self.num_draft_tokens_total += num_drafts
        self.num_accepted_tokens_total += num_accepted
        by_position = self.num_accepted_by_position
        for i in range(min(num_accepted, len(by_position))):
            by_position[i] += 1

    def _cache_new_full_block(self, request: Request) -> None:
        """A block just filled with known tokens: hash it, and cache it if its KV is scheduled."""
        update_block_hashes(request, self.block_size)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)

    # ── control and stats ───────────────────────────────────────────────────────────────
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.statistics()
        prefix = self.kv_cache_manager.prefix_cache_statistics()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_total=self.num_preempted_total,
            kv_usage=stats.usage,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_cached_free_blocks=stats.num_cached_free_blocks,
            prefix_queries_total=prefix.queries,
            prefix_hits_total=prefix.hits,
            step_num_prefill_tokens=self._last_num_prefill_tokens,
            step_num_decode_tokens=self._last_num_decode_tokens,
            step_token_budget=self.max_num_batched_tokens,
            spec_num_draft_tokens_total=self.num_draft_tokens_total,
            spec_num_accepted_tokens_total=self.num_accepted_tokens_total,
            spec_num_accepted_by_position=list(self.num_accepted_by_position),
            num_constrained=self.num_constrained,
        )

    def _fail_requests(self, failed: list[tuple[Request, Exception]]) -> list[EngineCoreOutput]:
        """Finish each request whose own update raised with finish_reason "error", freeing its
        blocks; the other requests of the step are untouched and the engine goes on. Runs only
        when a request's own update raised."""
        outputs = []
        for request, e in failed:
            logger.error("request %s failed in its update: %r", request.request_id, e,
                         extra=request_extra(request.request_id))  # fmt: skip
            if request.request_id in self.requests:
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [], FinishReason.ERROR, error=f"{type(e).__name__}: {e}"
                )
            )
        return outputs

    def kv_self_check(self) -> dict[str, object]:
        """Audit the block pool against the requests: ``{"ok", "idle", "problems", ...counts}``;
        `problems` is empty when sound.

        Always: the pool's own invariants; every block's ref_cnt equals the number of live
        requests holding it (no referenced block without an owner, no owner without a
        reference); queue membership matches status; a running request holds blocks for its
        computed tokens. When idle (no requests): additionally every block is free
        (free + cached == total). Runs on demand only (the `kv_self_check` utility call, and
        tests after every step): it walks every block and request, O(num_blocks + tokens held).
        """
        kv = self.kv_cache_manager
        pool = kv.block_pool
        problems = list(pool.check_invariants())
        owners: collections.Counter[int] = collections.Counter()
        for request_id in kv.req_to_blocks:
            if request_id not in self.requests:
                problems.append(f"blocks held by unknown request {request_id!r}")
            for blocks in kv.group_tables(request_id):
                for block in blocks:
                    owners[block.block_id] += 1
        for block in pool.blocks:
            if block.ref_cnt != owners[block.block_id]:
                problems.append(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"{owners[block.block_id]} owning requests"
                )
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        if len(running_ids) != len(self.running) or len(waiting_ids) != len(self.waiting):
            problems.append("a request is queued twice")
        if running_ids & waiting_ids:
            problems.append(f"requests both running and waiting: {sorted(running_ids & waiting_ids)}")
        if running_ids | waiting_ids != set(self.requests):
            problems.append("the queues and the request table disagree")
        if len(running_ids) > self.max_num_seqs:
            problems.append(f"{len(running_ids)} running requests exceed max_num_seqs")
        block_size = kv.block_size
        for request in self.running:
            held = len(kv.req_to_blocks.get(request.request_id, ()))
            if request.status != RequestStatus.RUNNING:
                problems.append(f"{request} is in running with status {request.status.name}")
            if held * block_size < request.num_computed_tokens:
                problems.append(f"{request} holds {held} blocks for its computed tokens")
            if request.num_tokens > request.max_num_tokens:
                problems.append(f"{request} is past its length limit {request.max_num_tokens}")
        for request in self.waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                problems.append(f"{request} is in waiting with status {request.status.name}")
            if request.request_id in kv.req_to_blocks or request.num_computed_tokens:
                problems.append(f"waiting {request} holds blocks or computed tokens")
        stats = pool.statistics()
        idle = not self.requests
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
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
        }


def _prompt_end_cap(request: Request, num_computed: int, num_new: int) -> int:
    """`num_new` tokens of `request` from `num_computed`, a chunk in the prompt cut at its end:
    recomputed output tokens (after preemption, or a prefix hit inside the outputs) then come
    in a step of their own, where each is a decode row of the attention, as when it was first
    computed (`vx.gpu.model_runner.ModelRunner.prepare_inputs`), never a row of a prefill
    chunk, whose attention rounds otherwise: with every row count on one GEMM, a request's
    greedy tokens then do not depend on whether it was preempted (nor, with speculative
    decoding, on its drafts). Costs one step more per recompute that reaches the outputs."""
    p = request.num_prompt_tokens
    return min(num_new, p - num_computed) if num_computed < p else num_new


def _invariant_cap(request: Request, num_computed: int, num_new: int) -> int:
    """`num_new` tokens of `request` from `num_computed`, cut for batch-invariant inference:
    up to its prompt's end while in the prompt, and one a step past it. A recomputed output
    token (after preemption, or a prefix hit inside the outputs) is then a decode row, through
    the decode attention as when it was first computed, never a row of a prefill chunk, whose
    attention rounds otherwise (`vx.gpu.model_runner.ModelRunner.prepare_inputs`)."""
    p = request.num_prompt_tokens
    return min(num_new, p - num_computed) if num_computed < p else min(num_new, 1)
