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
