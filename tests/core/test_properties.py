"""Property tests over random workloads: adds, aborts, steps, preemptions and prefix hits.

Checked at every step: blocks are conserved and ref counts match owners (the KV self-check);
the token budget and max_num_seqs are never exceeded; a preemption victim is always the tail
of `running`, resumed first; an abort frees the blocks at once; a prefix hit advances the
computed count without scheduling those tokens (and the hit blocks hold that very prefix);
every request's outputs are what the fake model yields on its own tokens (so async == sync).
The free queue is also checked against a plain-list model of LRU order.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings, strategies as st

from vx.core.block_pool import BlockPool
from vx.core.request import RequestStatus
from vx.messages import AddRequest, SchedulerOutput

from .helpers import Driver, FakeWorker, fake_model, make_add_request, make_scheduler

EOS_RATE = 40
PREFIXES = [[(p * 31 + i) % 40 + 1 for i in range(80)] for p in range(3)]


def expected_output(msg: AddRequest, max_model_len: int) -> tuple[list[int], str]:
    """What a request must produce, computed with no scheduler at all."""
    params = msg.sampling_params
    prompt = msg.prompt_token_ids
    limit = len(prompt) + params.max_tokens if params.max_tokens else max_model_len
    limit = max(min(limit, max_model_len), len(prompt) + 1)
    stops = set(params.stop_token_ids)
    if msg.eos_token_id is not None and not params.ignore_eos:
        stops.add(msg.eos_token_id)
    tokens, out = list(prompt), []
    while True:
        token = fake_model(tokens, EOS_RATE)
        tokens.append(token)
        out.append(token)
        if token in stops and len(out) > params.min_tokens:
            return out, "stop"
        if len(tokens) >= limit:
            return out, "length"


configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(3, 16),
        "max_num_batched_tokens": st.sampled_from([8, 16, 33, 64]),
        "max_num_seqs": st.integers(1, 6),
        "long_prefill_token_threshold": st.sampled_from([0, 0, 5]),
        "enable_prefix_caching": st.sampled_from([True, True, False]),
    }
)
adds = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.sampled_from([0, 16, 20, 32, 48, 80]),  # how much of it
    st.lists(st.integers(1, 40), max_size=12),  # own suffix
    st.integers(1, 40),  # max_tokens
    st.sampled_from([{}, {"ignore_eos": True}, {"stop_token_ids": [7]}, {"min_tokens": 3}]),
)
add_op = st.tuples(st.just("add"), adds)
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        add_op,
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    min_size=4,
    max_size=40,
)


def _event(label: str) -> None:
    """`hypothesis.event` when inside a test (coverage statistics), a no-op otherwise."""
    try:
        event(label)
    except Exception:
        pass


def make_msg(request_id: str, spec: tuple, max_model_len: int) -> AddRequest:
    prefix, n, suffix, max_tokens, extra = spec
    prompt = (PREFIXES[prefix][:n] + suffix)[: max_model_len - 1] or [1]
    if "min_tokens" in extra:
        extra = {"min_tokens": min(extra["min_tokens"], max_tokens)}
    return make_add_request(request_id, prompt, max_tokens=max_tokens, **extra)


class CheckedDriver(Driver):
    """A Driver that checks the scheduler's invariants around every schedule and update."""

    def __init__(self, scheduler, worker) -> None:
        super().__init__(scheduler, worker)
        real_schedule = scheduler.schedule

        def checked_schedule() -> SchedulerOutput:
            before_running = [r.request_id for r in scheduler.running]
            out = real_schedule()
            self.check_schedule(out, before_running)
            return out

        scheduler.schedule = checked_schedule  # type: ignore[method-assign]

    def step(self):  # type: ignore[override]
        outputs = super().step()
        report = self.scheduler.kv_self_check()
        assert report["ok"], report["problems"]
        return outputs

    def check_schedule(self, out: SchedulerOutput, before_running: list[str]) -> None:
        s = self.scheduler
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        # Preemption: the victims are the tail of running, now at the front of waiting.
        victims = [
            rid for rid in before_running if s.requests[rid].status == RequestStatus.PREEMPTED
        ]
        if victims:
            k = len(victims)
            assert victims == before_running[-k:], (victims, before_running)
            assert [r.request_id for r in s.waiting][:k] == victims
            assert not out.scheduled_new_reqs  # no admissions in a step that preempted
            assert set(victims) <= set(out.preempted_req_ids)
        # Prefix hits: the hit blocks hold exactly the request's prefix; hits are not scheduled.
        kv = s.kv_cache_manager
        for new in out.scheduled_new_reqs:
            request = s.requests[new.req_id]
            if new.num_computed_tokens == 0:
                continue
            assert s.enable_caching and new.num_computed_tokens % 16 == 0
            total = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            assert total <= request.num_tokens
            assert new.num_computed_tokens < request.num_tokens  # the last token is recomputed
            for i in range(new.num_computed_tokens // 16):
                block = kv.block_pool.blocks[new.block_ids[i]]
                assert block.block_hash == request.block_hashes[i]


def run_workload(config: dict, op_list: list, *, is_async: bool, with_aborts: bool) -> Driver:
    s = make_scheduler(async_scheduling=is_async, max_model_len=None, **config)
    d = CheckedDriver(s, FakeWorker(EOS_RATE))
    d.expected = {}  # type: ignore[attr-defined]
    d.aborted = set()  # type: ignore[attr-defined]
    n = 0
    for op, arg in op_list:
        if op == "add":
            msg = make_msg(f"r{n}", arg, s.max_model_len)
            n += 1
            s.add_request(msg)
            d.expected[msg.request_id] = expected_output(msg, s.max_model_len)  # type: ignore[attr-defined]
        elif op == "step":
            for _ in range(arg):
                d.step()
        elif with_aborts and s.requests:
            ids = sorted(s.requests)
            victim = ids[arg % len(ids)]
            free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
            held = len(s.kv_cache_manager.req_to_blocks.get(victim, ()))
            shared = sum(b.ref_cnt > 1 for b in s.kv_cache_manager.req_to_blocks.get(victim, ()))
            assert s.finish_requests([victim], RequestStatus.FINISHED_ABORTED) == [victim]
            # Freed at once: every block it held alone is back in the free queue.
            assert (
                s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + held - shared
            )
            d.aborted.add(victim)  # type: ignore[attr-defined]
    d.run()
    report = s.kv_self_check()
    assert report["ok"] and report["idle"], report["problems"]
    _event(f"preempted: {s.num_preempted_total > 0}")
    _event(f"prefix hits: {s.kv_cache_manager.prefix_cache_statistics().hits > 0}")
    _event(f"aborted: {bool(d.aborted)}")  # type: ignore[attr-defined]
    return d


def check_outputs(d: Driver) -> None:
    for request_id, (tokens, reason) in d.expected.items():  # type: ignore[attr-defined]
        got = d.tokens.get(request_id, [])
        if request_id in d.aborted:  # type: ignore[attr-defined]
            assert got == tokens[: len(got)]
            continue
        assert got == tokens, request_id
        assert d.finish[request_id][0] == reason


@settings(max_examples=60, deadline=None)
@given(config=configs, op_list=ops, is_async=st.booleans())
def test_random_workloads_keep_every_invariant(config, op_list, is_async) -> None:
    d = run_workload(config, op_list, is_async=is_async, with_aborts=True)
    check_outputs(d)


@settings(max_examples=40, deadline=None)
@given(config=configs, op_list=ops)
def test_async_outputs_equal_sync_outputs(config, op_list) -> None:
    sync = run_workload(config, op_list, is_async=False, with_aborts=False)
    asyn = run_workload(config, op_list, is_async=True, with_aborts=False)
    check_outputs(sync)
    assert asyn.tokens == sync.tokens
    assert asyn.finish == sync.finish


def random_workload(rng: random.Random) -> tuple[dict, list]:
    """The same kind of workload as the strategies above, drawn flat (hypothesis favours small
    examples; these are long enough to preempt in most seeds and hit the cache in most)."""
    config = {
        "num_blocks": rng.randint(3, 16),
        "max_num_batched_tokens": rng.choice([8, 16, 33, 64]),
        "max_num_seqs": rng.randint(1, 6),
        "long_prefill_token_threshold": rng.choice([0, 0, 5]),
        "enable_prefix_caching": rng.random() < 0.8,
    }
    op_list: list = []
    for _ in range(rng.randint(10, 60)):
        k = rng.random()
        if k < 0.5:
            suffix = [rng.randint(1, 40) for _ in range(rng.randrange(12))]
            extra = rng.choice(
                [{}, {"ignore_eos": True}, {"stop_token_ids": [7]}, {"min_tokens": 3}]
            )
            spec = (
                rng.randrange(3),
                rng.choice([0, 16, 20, 32, 48, 80]),
                suffix,
                rng.randint(1, 40),
                extra,
            )
            op_list.append(("add", spec))
        elif k < 0.9:
            op_list.append(("step", rng.randint(1, 6)))
        else:
            op_list.append(("abort", rng.randrange(1000)))
    return config, op_list


@pytest.mark.parametrize("seed", range(120))
def test_seeded_workloads_keep_every_invariant(seed: int) -> None:
    config, op_list = random_workload(random.Random(seed))
    check_outputs(run_workload(config, op_list, is_async=bool(seed % 2), with_aborts=True))


@pytest.mark.parametrize("seed", range(1000, 1080))
def test_seeded_async_outputs_equal_sync_outputs(seed: int) -> None:
    config, op_list = random_workload(random.Random(seed))
    sync = run_workload(config, op_list, is_async=False, with_aborts=False)
    asyn = run_workload(config, op_list, is_async=True, with_aborts=False)
    check_outputs(sync)
    assert (asyn.tokens, asyn.finish) == (sync.tokens, sync.finish)


def test_seeded_workloads_do_preempt_and_hit() -> None:
    """Guard the generator: the seeded runs above must really exercise preemption and hits."""
    num_preempted = num_hit = 0
    for seed in range(40):
        config, op_list = random_workload(random.Random(seed))
        s = run_workload(config, op_list, is_async=False, with_aborts=True).scheduler
        num_preempted += s.num_preempted_total > 0
        num_hit += s.kv_cache_manager.prefix_cache_statistics().hits > 0
    assert num_preempted >= 10 and num_hit >= 10


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 12))
def test_free_queue_is_exactly_lru(seed: int, num_blocks: int) -> None:
    """Random allocate / cache / touch / free against a plain-list model of the pool."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    model_queue = list(range(num_blocks))  # free block ids, eviction order
    model_hash: dict[int, bytes] = {}
    owners: list[list[int]] = []
    for _ in range(40):
        op = rng.randrange(4)
        if op == 0 and model_queue:
            n = rng.randint(1, len(model_queue))
            got = [b.block_id for b in pool.get_new_blocks(n)]
            assert got == model_queue[:n]  # least recently freed first
            del model_queue[:n]
            for bid in got:
                model_hash.pop(bid, None)
            owners.append(got)
        elif op == 1 and owners:
            held = owners.pop(rng.randrange(len(owners)))
            pool.free_blocks(reversed([pool.blocks[i] for i in held]))
            for bid in reversed(held):
                if pool.blocks[bid].ref_cnt == 0:
                    model_queue.append(bid)
        elif op == 2 and owners:
            held = owners[rng.randrange(len(owners))]
            blocks = [pool.blocks[i] for i in held]
            hashes = [f"h{rng.randrange(6)}".encode() for _ in held]
            pool.cache_full_blocks(blocks, hashes, 0, len(blocks))
            for bid, h in zip(held, hashes, strict=True):
                if bid not in model_hash and h not in model_hash.values():
                    model_hash[bid] = h
        elif op == 3 and model_hash:
            bid = rng.choice(sorted(model_hash))
            block = pool.get_cached_block(model_hash[bid])
            assert block is not None and block.block_id == bid
            pool.touch([block])
            if bid in model_queue:
                model_queue.remove(bid)
            owners.append([bid])
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == model_queue
        assert {b.block_id: b.block_hash for b in pool.blocks if b.block_hash} == model_hash
        assert pool.check_invariants() == []
