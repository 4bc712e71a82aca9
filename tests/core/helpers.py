"""Test helpers for vx.core: request/config builders, a fake worker and an engine-loop driver.

The fake worker keeps a persistent batch built only from the `SchedulerOutput` diffs (as the
real workers do), and "samples" with a deterministic function of all previous tokens, so that a
request's outputs do not depend on how it was scheduled, chunked, preempted or overlapped.
"""

from __future__ import annotations

import hashlib
from collections import deque

from vx.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.core.block_hash import update_block_hashes
from vx.core.request import Request
from vx.core.scheduler import Scheduler
from vx.messages import AddRequest, EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from vx.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def make_config(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    long_prefill_token_threshold: int = 0,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = True,
    max_model_len: int | None = 256,
    small_step_tokens: int = 0,
    small_step_running: int = 48,
    burst_step_tokens: int = 0,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            async_scheduling=async_scheduling,
            small_step_tokens=small_step_tokens,
            small_step_running=small_step_running,
            burst_step_tokens=burst_step_tokens,
        ),
    )


def make_scheduler(num_blocks: int = 64, **kwargs: object) -> Scheduler:
    return Scheduler(make_config(**kwargs), num_blocks)  # type: ignore[arg-type]


def make_add_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int | None = 16,
    eos_token_id: int | None = EOS,
    cache_salt: str | None = None,
    lora_id: int | None = None,
    **params: object,
) -> AddRequest:
    return AddRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams.create(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        cache_salt=cache_salt,
        lora_id=lora_id,
    )


def make_request(
    request_id: str, prompt_token_ids: list[int], *, max_model_len: int = 4096, **kwargs: object
) -> Request:
    """A Request with its block hashes computed, as `Scheduler.add_request` leaves it."""
    request = Request.from_add_request(
        make_add_request(request_id, prompt_token_ids, **kwargs),  # type: ignore[arg-type]
        max_model_len=max_model_len,
    )
    update_block_hashes(request, 16)
    return request


def fake_model(tokens: list[int], eos_rate: int = 0) -> int:
    """Next token = a hash of all previous tokens; EOS with probability ~1/eos_rate."""
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    if eos_rate and value % eos_rate == 0:
        return EOS
    return 1 + value % (VOCAB - 1)


class FakeWorker:
    """Applies SchedulerOutput diffs to a persistent batch and samples with `fake_model`.

    Checks the diff protocol as it goes: cached requests must be known, new ones unknown, the
    computed count must match the worker's own, and block tables must cover the tokens.
    """

    def __init__(self, eos_rate: int = 0) -> None:
        self.eos_rate = eos_rate
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for request_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.tokens.pop(request_id, None)
            self.num_computed.pop(request_id, None)
            self.block_ids.pop(request_id, None)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        ids = [r.req_id for r in out.scheduled_new_reqs] + out.scheduled_cached_reqs.req_ids
        assert sorted(ids) == sorted(out.num_scheduled_tokens), "scheduled ids mismatch"
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.block_ids[new.req_id] = list(new.block_ids)
        cached = out.scheduled_cached_reqs
        for request_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            assert request_id in self.tokens, f"{request_id} cached but unknown"
            assert self.num_computed[request_id] == num_computed, request_id
            self.block_ids[request_id].extend(new_blocks)
        req_ids, sampled = [], []
        for request_id, n in out.num_scheduled_tokens.items():
            tokens = self.tokens[request_id]
            end = self.num_computed[request_id] + n
            assert end <= len(tokens), f"{request_id} scheduled past its known tokens"
            assert len(self.block_ids[request_id]) * 16 >= end, f"{request_id} lacks blocks"
            self.num_computed[request_id] = end
            req_ids.append(request_id)
            if end == len(tokens):
                token = fake_model(tokens, self.eos_rate)
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)


class Driver:
    """The EngineCore loop in miniature: a batch queue of 1 (sync) or 2 (async)."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.depth = 2 if scheduler.async_scheduling else 1
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[str | None, int | None]] = {}
        self.outputs: list[EngineCoreOutput] = []

    def step(self) -> list[EngineCoreOutput]:
        """Schedule (up to the queue depth), then apply the oldest in-flight step."""
        s = self.scheduler
        if len(self.in_flight) < self.depth and s.has_unfinished_requests():
            out = s.schedule()
            if out.total_num_scheduled_tokens:
                self.in_flight.append((out, self.worker.execute(out)))
                if len(self.in_flight) < self.depth:
                    return []
        if not self.in_flight:
            return []
        out, result = self.in_flight.popleft()
        outputs = s.update_from_output(out, result)
        for o in outputs:
            assert o.request_id not in self.finish, f"output after finish for {o.request_id}"
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = (o.finish_reason, o.stop_reason)
        self.outputs.extend(outputs)
        return outputs

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.in_flight and not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("driver did not finish")
