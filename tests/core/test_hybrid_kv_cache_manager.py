"""HybridKVCacheManager: a block table per KV-cache group over one pool (a global group and
windowed ones, as Gemma 2/3): blocks freed per group, one budget, prefix hits valid in every
group, and the scheduler over it (chunks, shared prefixes, preemption, async)."""

from __future__ import annotations

import msgspec
import pytest

from vx.core.block_pool import NULL_BLOCK
from vx.core.hybrid_kv_cache_manager import HybridKVCacheManager
from vx.core.request import Request
from vx.core.scheduler import Scheduler

from .helpers import Driver, FakeWorker, make_add_request, make_config, make_request

BS = 16


def schedule(manager, request: Request, num_new: int, hits=(), num_hit=0) -> list[int]:
    ids = manager.allocate_slots(request, num_new, num_hit, list(hits))
    assert ids is not None
    request.num_computed_tokens += num_hit + num_new
    return ids


def test_windowed_groups_free_and_the_global_group_keeps() -> None:
    """Groups (global, W=20, W=20): each step adds as many blocks to every group (one
    budget: G x new blocks); the windowed groups give back the blocks before key
    n - W + 1, the global one keeps all; freeing returns every live block once."""
    m = HybridKVCacheManager(40, [None, 20, 20])
    r = make_request("0", list(range(200, 300)))  # 100 tokens
    ids = schedule(m, r, 40)
    assert len(ids) == 9 and len(set(ids)) == 9  # 3 blocks in each of 3 groups
    assert m.block_pool.get_num_free_blocks() == 31
    schedule(m, r, 40)  # after 40 computed: block 0 (keys 0-15) left both windows
    g, w1, w2 = m.req_to_groups["0"]
    assert len(g) == len(w1) == len(w2) == 5
    assert w1[0] is NULL_BLOCK and w2[0] is NULL_BLOCK and NULL_BLOCK not in g
    assert m.num_held_blocks("0") == 5 + 4 + 4
    assert m.block_pool.get_num_free_blocks() == 40 - 13
    schedule(m, r, 20)  # after 80: keys < 61 dead, blocks 0-2 out of both windows
    assert w1.num_freed == w2.num_freed == 3 and m.num_held_blocks("0") == 7 + 4 + 4
    assert m.block_pool.check_invariants() == []
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 40
    assert m.block_pool.check_invariants() == []


def test_one_budget_refuses_whole_and_changes_nothing() -> None:
    m = HybridKVCacheManager(8, [None, 32])
    r = make_request("0", list(range(100)))
    assert m.allocate_slots(r, 70) is None  # 5 blocks per group: 10 > 8
    assert m.block_pool.get_num_free_blocks() == 8 and "0" not in m.req_to_groups
    assert len(schedule(m, r, 64)) == 8
    # the longest context alone: global holds all, the window 32 keys + a 64-token chunk
    assert m.max_tokens_alone(64) == 4 * BS  # 4 + min(4, 7) = 8 <= 8, 5 + 5 > 8
    assert HybridKVCacheManager(100, [None, 32]).max_tokens_alone(64) == (100 - 7) * BS


def test_prefix_hit_needs_only_the_window_in_windowed_groups() -> None:
    """A hit of n blocks: the global group's blocks 0..n-1, a windowed group's last
    ceil((W - 1) / 16) only (the others come back as NULL_BLOCK, -1 on the wire); blocks freed
    out of a window may be reused without spoiling the hit; a missing block inside the last
    window shortens it."""
    m = HybridKVCacheManager(30, [None, 20])
    prompt = list(range(300, 400))  # 100 tokens: 6 full blocks
    r0 = make_request("0", prompt)
    schedule(m, r0, 50)
    schedule(m, r0, 50)
    win = m.req_to_groups["0"][1]
    assert win.num_freed == 1  # keys < 31 out of the window after 50: block 0 freed
    m.free(r0)

    r1 = make_request("1", prompt[:90] + [1, 2])  # shares 5 full blocks
    hits, n = m.get_computed_blocks(r1)
    assert n == 5 * BS and len(hits) == 10
    assert NULL_BLOCK not in hits[:5]
    assert hits[5:8] == [NULL_BLOCK] * 3 and NULL_BLOCK not in hits[8:]  # W=20: 2 blocks
    ids = schedule(m, r1, 92 - n, hits, n)
    assert ids[6:9] == [-1, -1, -1] and ids[:5] == [b.block_id for b in hits[:5]]
    assert m.req_to_groups["1"][1].num_freed == 3
    assert m.num_held_blocks("1") == 6 + 3
    m.free(r1)
    assert m.block_pool.get_num_free_blocks() == 30
    assert m.block_pool.check_invariants() == []

    # the windowed group's blocks before the last window go (reused): still the same hit
    cached = m.block_pool.cached_block_hash_to_block
    for h in r0.block_hashes[:3]:
        evict(m, cached[h + b"\x01"])  # group 1's key: the hash and the group byte
    hits2, n2 = m.get_computed_blocks(r1)
    assert n2 == n and [b.block_id for b in hits2] == [b.block_id for b in hits]
    evict(m, hits[0])  # the global group's first block: no hit at all
    assert m.get_computed_blocks(r1) == ([], 0)
    assert m.block_pool.check_invariants() == []


def evict(m: HybridKVCacheManager, block) -> None:
    """Drop a free block's hash, as its reuse from the free queue would."""
    assert block.ref_cnt == 0 and block.block_hash is not None
    del m.block_pool.cached_block_hash_to_block[block.block_hash]
    block.block_hash = None
    m.block_pool.num_cached_free_blocks -= 1


def test_windowed_hit_shortens_to_a_full_window() -> None:
    """The windowed group's block 4 is missing: the longest hit whose last window is whole
    ends at block 4 (blocks 2-3), within the global group's 5."""
    m = HybridKVCacheManager(30, [None, 20])
    prompt = list(range(300, 400))
    r0 = make_request("0", prompt)
    schedule(m, r0, 99)
    m.free(r0)
    evict(m, m.get_computed_blocks(make_request("x", prompt))[0][6 + 4])  # group 1, block 4
    hits, n = m.get_computed_blocks(make_request("1", prompt[:90] + [1]))
    assert n == 4 * BS and hits[4:6] == [NULL_BLOCK] * 2
    assert m.block_pool.check_invariants() == []


@pytest.mark.parametrize("is_async", [False, True])
def test_scheduler_reads_only_live_blocks_per_group(is_async: bool) -> None:
    """The scheduler over (global, W=24, W=24) with chunked prefills, shared prefixes,
    decodes and preemption in a small pool: a fake KV content per (group, slot) checks that
    every key a layer reads (all keys in the global group, the window in a windowed one)
    still holds that key; the audit holds after every step; a request holds its whole
    context once and its window (and chunk) in each windowed group, never more."""
    W = 24

    class GroupWorker(FakeWorker):
        def __init__(self) -> None:
            super().__init__()
            self.slots: dict[tuple[int, int], int] = {}
            self.tables: dict[str, list[list[int]]] = {}

        def execute(self, out):
            starts = {}
            for new in out.scheduled_new_reqs:
                starts[new.req_id] = new.num_computed_tokens
                n = len(new.block_ids) // 3
                self.tables[new.req_id] = [new.block_ids[g * n : (g + 1) * n] for g in range(3)]
            cached = out.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                n = len(ids) // 3
                for g in range(3):
                    self.tables[rid][g].extend(ids[g * n : (g + 1) * n])
            result = super().execute(out)
            for rid, n in out.num_scheduled_tokens.items():
                toks, c = self.tokens[rid], starts[rid]
                for g, table in enumerate(self.tables[rid]):
                    for p in range(c, c + n):
                        assert table[p // BS] >= 0, (rid, g, p)
                        self.slots[table[p // BS], p % BS] = hash(tuple(toks[: p + 1]))
                    for p in range(c, c + n):
                        first = 0 if g == 0 else max(0, p - W + 1)
                        for k in range(first, p + 1):
                            held = self.slots.get((table[k // BS], k % BS))
                            assert held == hash(tuple(toks[: k + 1])), (rid, g, p, k)
            return result

    config = make_config(max_num_batched_tokens=40, async_scheduling=is_async,
                         max_model_len=200)  # fmt: skip
    s = Scheduler(config, 40, group_windows=[None, W, W])
    shared = list(range(100, 140))
    for i in range(6):
        s.add_request(make_add_request(str(i), shared + [i] * (10 + 17 * i), max_tokens=30))
    d = Driver(s, GroupWorker())
    for _ in range(3000):
        if not d.in_flight and not s.has_unfinished_requests():
            break
        d.step()
        report = s.kv_self_check()
        assert report["ok"], report["problems"]
        kv = s.kv_cache_manager
        for r in s.running:
            tables = kv.group_tables(r.request_id)
            whole = -(-(r.num_computed_tokens + 1) // BS) + 1
            assert len(tables[0]) <= whole
            for t in tables[1:]:
                assert len(t) - t.num_freed <= -(-(W + 40) // BS) + 1
    assert len(d.finish) == 6 and all(len(t) == 30 for t in d.tokens.values())
    assert s.num_preempted_total > 0  # the small pool did preempt: resumption was exercised


def test_windows_free_enough_that_nothing_is_preempted(monkeypatch) -> None:
    """Four requests of 200 tokens in a 100-block pool with groups (global, W=16 x 3): kept
    whole, each request would hold 4 x 13 blocks, 208 for the four, and preemption follows
    (checked with the freeing switched off); the windows free enough (13 + 3 x 2 blocks
    each while decoding) that no request is preempted."""

    def run() -> Scheduler:
        config = make_config(max_num_batched_tokens=64, max_model_len=256)
        s = Scheduler(config, 100, group_windows=[None, 16, 16, 16])
        for i in range(4):
            s.add_request(make_add_request(str(i), [i + 1] * 180, max_tokens=20))
        d = Driver(s, FakeWorker())
        d.run(2000)
        assert s.kv_self_check()["ok"] and len(d.finish) == 4
        return s

    assert run().num_preempted_total == 0
    monkeypatch.setattr(HybridKVCacheManager, "_free_out_of_windows", lambda *a: None)
    assert run().num_preempted_total > 0


def test_only_group_0_announces_kv_events() -> None:
    """A router sees each prefix once: the global group 0's blocks stored and removed; the
    other groups' keys (hash + group byte) are never announced, stored or evicted."""
    from vx.core.kv_events import BlockRemoved, BlockStored, external_hash

    m = HybridKVCacheManager(12, [None, 20], kv_events_medium="CPU")
    r0 = make_request("0", list(range(500, 548)))  # 3 full blocks
    schedule(m, r0, 48)
    events = m.block_pool.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].block_hashes == [external_hash(h) for h in r0.block_hashes[:3]]
    m.free(r0)
    r1 = make_request("1", list(range(900, 900 + 16 * 12)))
    schedule(m, r1, 16 * 6)  # reuses all 12 blocks: both groups' hashed ones evicted
    removed = [h for e in m.block_pool.take_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes]  # fmt: skip
    assert sorted(removed) == sorted(external_hash(h) for h in r0.block_hashes[:3])


def test_window_of_one_key_keeps_the_global_hit() -> None:
    """A window of 1 key (legal for `WindowedAttention`): the first recomputed query reads
    only itself, so the windowed group needs none of the hit's blocks and the hit is the
    global group's whole prefix (it used to shrink block by block to nothing)."""
    m = HybridKVCacheManager(30, [None, 1])
    prompt = list(range(300, 364))  # 4 full blocks
    r0 = make_request("0", prompt)
    schedule(m, r0, 64)
    m.free(r0)
    hits, n = m.get_computed_blocks(make_request("1", prompt + [1]))
    assert n == 4 * BS and hits[4:] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hits[:4]


class _ContentWorker:
    """A worker that keeps a fake KV content per (block, offset) and checks every key each
    layer group reads (the whole context in a global group, the window in a windowed one)
    is one the request still holds and still holds that key; it scores drafts against
    `fake_model`, and drops the blocks past its computed tokens (rejected drafts') when the
    request is next scheduled, as the Worker does (`vx.gpu.input_batch.InputBatch.update`)."""

    def __init__(self, windows: list[int | None], rng, spec: bool, kv) -> None:
        self.windows, self.rng, self.spec, self.kv = windows, rng, spec, kv
        self.slots: dict[tuple[int, int], int] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        #: async scheduling: each request's latest proposals, which fill its next slots
        self.drafts: dict[str, list[int]] = {}

    def _append(self, rid: str, ids: list[int]) -> None:
        n = len(ids) // len(self.windows)
        assert n * len(self.windows) == len(ids), "ids not group by group"
        for g, table in enumerate(self.tables[rid]):
            table.extend(ids[g * n : (g + 1) * n])

    def execute(self, out):
        from vx.messages import ModelRunnerOutput

        from .helpers import fake_model

        for rid in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.tokens.pop(rid, None)
            self.drafts.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.computed[new.req_id] = new.num_computed_tokens
            self.tables[new.req_id] = [[] for _ in self.windows]
            self._append(new.req_id, list(new.block_ids))
        cached = out.scheduled_cached_reqs
        for rid, ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            # async drafts: the scheduler's count runs ahead by rejections it has not heard of
            assert self.computed[rid] <= num_computed, rid
            if self.spec:  # blocks past the computed tokens held rejected drafts only
                keep = -(-num_computed // BS)
                for table in self.tables[rid]:
                    del table[keep:]
            self._append(rid, ids)
        req_ids, sampled, proposed, scored = [], [], {}, {}
        for rid, n in out.num_scheduled_tokens.items():
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            if drafts and drafts[0] == -1:  # slots: filled with our latest proposals
                mine = self.drafts.get(rid, [])[: len(drafts)]
                n -= len(drafts) - len(mine)
                scored[rid] = len(mine)
                drafts = mine
            toks, c = self.tokens[rid], self.computed[rid]
            step = toks + list(drafts)
            for g, table in enumerate(self.tables[rid]):
                for p in range(c, c + n):
                    assert table[p // BS] >= 0, ("written to a freed block", rid, g, p)
                    self.slots[table[p // BS], p % BS] = hash(tuple(step[: p + 1]))
                w = self.windows[g]
                held_now = self.kv.group_tables(rid)[g]  # the step runs before the next frees
                for p in range(c, c + n):
                    for k in range(0 if w is None else max(0, p - w + 1), p + 1):
                        block = held_now[k // BS]
                        live = block.block_id == table[k // BS] and block.ref_cnt > 0
                        assert live, ("read a block it no longer holds", rid, g, p, k)
                        held = self.slots.get((table[k // BS], k % BS))
                        assert held == hash(tuple(step[: k + 1])), (rid, g, p, k)
            req_ids.append(rid)
            if c + n < len(toks):
                self.computed[rid] = c + n
                sampled.append([])
                continue
            accepted: list[int] = []
            for d in drafts:
                if fake_model(toks + accepted) != d:
                    break
                accepted.append(d)
            accepted.append(fake_model(toks + accepted))
            self.computed[rid] = c + n - (len(drafts) + 1 - len(accepted))
            toks.extend(accepted)
            sampled.append(accepted)
            if self.spec:  # the true continuation, a draft now and then wrong
                prop: list[int] = []
                for _ in range(self.rng.randint(0, 4)):
                    t = fake_model(toks + prop)
                    prop.append(t % 40 + 3 if self.rng.random() < 0.25 else t)
                proposed[rid] = prop
                self.drafts[rid] = prop
        return ModelRunnerOutput(
            step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled,
            spec_token_ids=proposed if self.spec else None,
            spec_num_scored=scored or None,
        )  # fmt: skip


@pytest.mark.parametrize("seed", range(24))
def test_random_traffic_reads_only_live_blocks(seed: int) -> None:
    """Random traffic over random groups (several global groups, two window kinds, windows
    below and above a block, of one key), pools small enough to preempt, shared prefixes,
    aborts, caching on or off, async scheduling, drafts (async: slots) rolled back: every key any
    group reads holds its token, nothing is written to a freed block, the audit holds after
    every step and the pool is whole at the end."""
    import random

    from vx.core.request import RequestStatus

    rng = random.Random(seed)
    windows = rng.choice([[None, 16], [None, 17], [None, 24, 24], [None, None, 33, 33, 33],
                          [None, 16, 40], [None, 2], [None, 1, 8], [None, None, 8, 8, 8]])  # fmt: skip
    spec = seed % 3 == 0
    config = make_config(
        max_num_batched_tokens=rng.choice([16, 24, 40, 64]), max_model_len=128,
        async_scheduling=seed % 2 == 0, max_num_seqs=rng.randint(2, 8),
        enable_prefix_caching=seed % 5 != 4,
    )  # fmt: skip
    if spec:  # the scheduler frees rejected drafts' blocks as configured for them
        from vx.config import SpeculativeConfig

        config = msgspec.structs.replace(
            config, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)
        )
    s = Scheduler(config, rng.randint(30, 80), group_windows=windows)
    shared = [rng.randint(1, 49) for _ in range(rng.randint(0, 60))]
    for i in range(rng.randint(3, 10)):
        prompt = shared[: rng.randint(0, len(shared))]
        prompt += [rng.randint(1, 49) for _ in range(rng.randint(1, 50))]
        s.add_request(make_add_request(str(i), prompt, max_tokens=rng.randint(1, 40)))
    d = Driver(s, _ContentWorker(windows, rng, spec, s.kv_cache_manager))
    for _ in range(5000):
        if not d.in_flight and not s.has_unfinished_requests():
            break
        d.step()
        report = s.kv_self_check()
        assert report["ok"], report["problems"]
        if s.requests and rng.random() < 0.03:
            s.finish_requests(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
    report = s.kv_self_check()
    assert report["ok"] and report["idle"], report
