"""KVCacheManager: prefix hits, allocation, caching as blocks fill, free order (vLLM's style:
exact block ids and exact free-queue order)."""

from __future__ import annotations

from vx.core.block_hash import update_block_hashes
from vx.core.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from vx.core.request import Request

from .helpers import make_request

COMMON = list(range(100, 148))  # three full blocks shared by several prompts


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def schedule(manager: KVCacheManager, request: Request, num_new: int, hits=(), num_hit=0):
    """What the scheduler does on admission: allocate, then advance the computed count."""
    ids = manager.allocate_slots(request, num_new, num_hit, list(hits))
    assert ids is not None
    request.num_computed_tokens += num_hit + num_new
    return ids


def test_prefill_prefix_hit_and_free_order() -> None:
    manager = KVCacheManager(11)
    r0 = make_request("0", COMMON + [1, 2, 3, 4, 5, 6, 7])  # 55 tokens
    hits, num_hit = manager.get_computed_blocks(r0)
    assert (hits, num_hit) == ([], 0)
    assert schedule(manager, r0, 55) == [0, 1, 2, 3]
    # The three full blocks are cached at once; the partial fourth is not.
    assert [b.block_hash for b in manager.req_to_blocks["0"][:3]] == r0.block_hashes
    assert manager.req_to_blocks["0"][3].block_hash is None
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10]

    r1 = make_request("1", COMMON + [9, 9, 9, 9, 9])  # 53 tokens, shares 3 blocks
    hits, num_hit = manager.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [0, 1, 2] and num_hit == 48
    assert schedule(manager, r1, 5, hits, num_hit) == [0, 1, 2, 4]
    assert [b.ref_cnt for b in manager.block_pool.blocks[:5]] == [2, 2, 2, 1, 1]
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10]

    manager.free(r0)  # shared blocks stay referenced by r1; only block 3 is freed
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 3]
    manager.free(r1)  # reverse order: its tail block first, the shared root last
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1, 0]
    assert manager.block_pool.check_invariants() == []

    # A hit on free blocks pulls them out of the middle of the queue.
    r2 = make_request("2", COMMON + list(range(16)) + [1])
    hits, num_hit = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1, 2]
    assert schedule(manager, r2, 17, hits, num_hit) == [0, 1, 2, 5, 6]
    assert free_ids(manager) == [7, 8, 9, 10, 3, 4]
    stats = manager.prefix_cache_statistics()
    assert (stats.queries, stats.hits) == (55 + 53 + 65, 48 + 48)


def test_last_prompt_token_is_always_recomputed() -> None:
    manager = KVCacheManager(8)
    r0 = make_request("0", COMMON)
    schedule(manager, r0, 48)
    r1 = make_request("1", COMMON)  # identical prompt, fully cached
    hits, num_hit = manager.get_computed_blocks(r1)
    # Never the whole prompt: the last block is recomputed so the last token yields logits.
    assert num_hit == 32 and [b.block_id for b in hits] == [0, 1]


def test_hit_stops_at_first_miss() -> None:
    manager = KVCacheManager(8)
    r0 = make_request("0", COMMON + [1])
    schedule(manager, r0, 49)
    other = [5] * 16 + COMMON[16:] + [1]  # block 0 differs: blocks 1, 2 cannot hit
    hits, num_hit = manager.get_computed_blocks(make_request("1", other))
    assert (hits, num_hit) == ([], 0)


def test_allocation_failure_changes_nothing() -> None:
    manager = KVCacheManager(4)
    r0 = make_request("0", list(range(40)))
    schedule(manager, r0, 40)  # 3 blocks
    before = free_ids(manager)
    r1 = make_request("1", list(range(500, 540)))
    assert manager.allocate_slots(r1, 40) is None
    assert free_ids(manager) == before
    assert "1" not in manager.req_to_blocks
    assert manager.prefix_cache_statistics().queries == 40  # only the admitted one counted


def test_evictable_hits_count_against_the_free_pool() -> None:
    manager = KVCacheManager(4)
    r0 = make_request("0", list(range(33)))
    schedule(manager, r0, 33)
    manager.free(r0)  # 3 blocks free, 2 of them cached
    r1 = make_request("1", list(range(32)) + list(range(900, 940)))  # 72 tokens: 5 blocks
    hits, num_hit = manager.get_computed_blocks(r1)
    assert num_hit == 32
    # 2 evictable hits + 3 new blocks > 4 free blocks
    assert manager.allocate_slots(r1, 40, num_hit, hits) is None
    assert manager.block_pool.get_num_free_blocks() == 4
    assert all(b.ref_cnt == 0 for b in hits)


def test_decode_fills_and_caches_blocks_as_they_fill() -> None:
    manager = KVCacheManager(8)
    r = make_request("0", list(range(14)))
    assert schedule(manager, r, 14) == [0]
    for t in range(2):  # tokens 14 and 15 complete block 0 (the scheduler hashes on append)
        r.append_output_token_id(50 + t)
        update_block_hashes(r, 16)
        assert schedule(manager, r, 1) is NO_NEW_BLOCKS
    # Token 15 was known when it was scheduled, so block 0 is cached with that schedule.
    assert manager.req_to_blocks["0"][0].block_hash == r.block_hashes[0]
    r.append_output_token_id(52)
    assert schedule(manager, r, 1) == [1]
    assert manager.req_to_blocks["0"].num_cached_blocks == 1


def test_placeholders_are_never_cached() -> None:
    manager = KVCacheManager(8)
    r = make_request("0", list(range(31)))
    schedule(manager, r, 31)
    r.num_output_placeholders = 2  # two tokens in flight, ids unknown
    # Positions 31, 32 scheduled: block 1 is full of positions but token 31 is unknown.
    assert schedule(manager, r, 1) == []
    assert r.num_computed_tokens == 32
    assert manager.req_to_blocks["0"][1].block_hash is None
    assert schedule(manager, r, 1) == [2]
    assert manager.req_to_blocks["0"][1].block_hash is None
    # The token arrives: now the block is known and its KV scheduled, so it is cached.
    r.append_output_token_id(7)
    r.num_output_placeholders -= 1
    update_block_hashes(r, 16)
    manager.cache_blocks(r, r.num_computed_tokens)
    assert manager.req_to_blocks["0"][1].block_hash == r.block_hashes[1]


def test_full_sequence_must_fit_gate() -> None:
    manager = KVCacheManager(4)
    r = make_request("0", list(range(80)))  # 5 blocks: can never fit in 4
    assert manager.allocate_slots(r, 16, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(r, 16) == [0]  # the first chunk alone would fit


def test_caching_disabled() -> None:
    manager = KVCacheManager(8, enable_caching=False)
    r0 = make_request("0", COMMON + [1])
    schedule(manager, r0, 49)
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request("1", COMMON + [1])) == ([], 0)
    manager.free(r0)
    assert manager.block_pool.check_invariants() == []


def test_prompt_logprobs_skip_prefix_reads() -> None:
    manager = KVCacheManager(8)
    schedule(manager, make_request("0", COMMON + [1]), 49)
    r1 = make_request("1", COMMON + [1], prompt_logprobs=1)
    assert manager.get_computed_blocks(r1) == ([], 0)


def test_reset_prefix_cache_and_statistics() -> None:
    manager = KVCacheManager(8)
    r = make_request("0", COMMON + [1])
    schedule(manager, r, 49)
    assert manager.usage == 4 / 8
    assert manager.reset_prefix_cache() is False
    manager.free(r)
    assert manager.statistics().num_cached_free_blocks == 3
    assert manager.reset_prefix_cache() is True
    assert manager.statistics().num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("1", COMMON + [1])) == ([], 0)
    assert manager.get_block_ids("0") == []


def test_sliding_window_frees_blocks_out_of_every_window() -> None:
    """Every layer windowed (W = 20 keys): once n tokens are computed, the blocks wholly
    before key n - W + 1 go back to the pool (in their places NULL_BLOCK, ids unchanged for the
    rest); a freed block keeps its hash until reused, so it stays a correct prefix hit, and a
    reused one is no hit at all. Without a window nothing is freed."""
    from vx.core.block_pool import NULL_BLOCK

    manager = KVCacheManager(12, sliding_window=20)
    prompt = list(range(200, 300))  # 100 tokens
    r0 = make_request("0", prompt)
    assert schedule(manager, r0, 40) == [0, 1, 2]
    # next chunk after 40 computed: keys < 21 are dead, block 0 (keys 0-15) is freed
    assert schedule(manager, r0, 40) == [3, 4]
    table = manager.req_to_blocks["0"]
    assert table[0] is NULL_BLOCK and table.num_freed == 1
    assert manager.num_held_blocks("0") == 4
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 11, 0]
    # after 80: keys < 61 dead, blocks 1-2 (keys 16-47) freed, the later first
    assert schedule(manager, r0, 20) == [5, 6]
    assert table.num_freed == 3 and free_ids(manager)[-3:] == [0, 2, 1]
    # the window (20 keys) and the next chunk: what r0 holds now
    assert manager.num_held_blocks("0") == 4
    assert manager.block_pool.check_invariants() == []

    # the freed blocks still hold r0's first 48 tokens under their hashes: a hit
    r1 = make_request("1", prompt[:70] + [1, 2, 3])
    hits, num_hit = manager.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [0, 1, 2, 3] and num_hit == 64
    # evict them: r2 takes every free block, so block 0 is reused and loses its hash
    r2 = make_request("2", list(range(1000, 1000 + 16 * 8)))
    schedule(manager, r2, 16 * manager.block_pool.get_num_free_blocks())
    assert manager.get_computed_blocks(r1) == ([], 0)
    manager.free(r2)
    manager.free(r0)  # the NULL_BLOCK places are not freed again
    assert manager.block_pool.get_num_free_blocks() == 12
    assert manager.block_pool.check_invariants() == []

    whole = KVCacheManager(12)  # a global layer: every block stays
    r3 = make_request("3", prompt)
    schedule(whole, r3, 40)
    schedule(whole, r3, 40)
    assert whole.num_held_blocks("3") == 5 and whole.req_to_blocks["3"].num_freed == 0


def test_sliding_window_scheduler_reads_only_live_blocks() -> None:
    """The scheduler with a windowed pool (W = 24), driven with chunked prefills, shared
    prefixes, decodes and preemption (a 14-block pool), sync and async: a fake KV content per
    slot checks that every key a query's window reads still holds that key (no freed block was
    reused while a window could see it), the audit holds after every step, and no request ever
    holds more than its window and its chunk need."""
    from vx.core.scheduler import Scheduler

    from .helpers import Driver, FakeWorker, make_add_request, make_config

    W, BS = 24, 16

    class WindowWorker(FakeWorker):
        def __init__(self) -> None:
            super().__init__()
            self.slots: dict[tuple[int, int], int] = {}

        def execute(self, out):
            starts = {}
            for new in out.scheduled_new_reqs:
                starts[new.req_id] = new.num_computed_tokens
            cached = out.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            result = super().execute(out)
            for rid, n in out.num_scheduled_tokens.items():
                toks, ids, c = self.tokens[rid], self.block_ids[rid], starts[rid]
                for p in range(c, c + n):  # the step writes its keys, then attends
                    self.slots[ids[p // BS], p % BS] = hash(tuple(toks[: p + 1]))
                for p in range(c, c + n):
                    for k in range(max(0, p - W + 1), p + 1):
                        held = self.slots.get((ids[k // BS], k % BS))
                        assert held == hash(tuple(toks[: k + 1])), (rid, p, k)
            return result

    for is_async in (False, True):
        config = make_config(max_num_batched_tokens=40, async_scheduling=is_async,
                             max_model_len=200)  # fmt: skip
        s = Scheduler(config, 14, sliding_window=W)
        shared = list(range(100, 140))
        for i in range(6):
            s.add_request(make_add_request(str(i), shared + [i] * (10 + 17 * i), max_tokens=30))
        d = Driver(s, WindowWorker())
        for _ in range(2000):
            if not d.in_flight and not s.has_unfinished_requests():
                break
            d.step()
            report = s.kv_self_check()
            assert report["ok"], report["problems"]
            for r in s.running:  # the window's blocks, this step's chunk and one of slack
                assert s.kv_cache_manager.num_held_blocks(r.request_id) <= -(-(W + 40) // BS) + 1
        assert len(d.finish) == 6 and all(len(t) == 30 for t in d.tokens.values())
