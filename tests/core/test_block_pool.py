"""BlockPool and its free queue: exact ids, exact order, lazy eviction, invariants."""

from __future__ import annotations

import pytest

from vx.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_operations_keep_order_and_count() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4, 5]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[3])  # from the middle, O(1)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 4, 5]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    queue.append(blocks[0])
    queue.append(blocks[3])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [4, 5, 0, 3]
    assert queue.num_free_blocks == 4
    with pytest.raises(ValueError):
        queue.remove(blocks[1])  # not in the queue
    with pytest.raises(ValueError):
        queue.popleft_n(5)
    assert [b.block_id for b in queue.popleft_n(4)] == [4, 5, 0, 3]
    with pytest.raises(ValueError):
        queue.popleft()
    queue.append(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2]


def test_new_blocks_come_from_the_head_with_ref_cnt_one() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == [3, 4, 5, 6, 7]
    assert pool.get_usage() == pytest.approx(3 / 8)
    assert pool.check_invariants() == []


def test_freed_blocks_keep_their_hash_and_go_to_the_tail() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2)
    assert pool.get_cached_block(b"h0") is blocks[0]
    pool.free_blocks(reversed(blocks))  # a request frees its last block first
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert pool.get_cached_block(b"h1") is blocks[1]  # still hit-able
    stats = pool.statistics()
    assert (stats.num_free_blocks, stats.num_cached_free_blocks, stats.num_cached_blocks) == (
        6,
        2,
        2,
    )
    assert pool.check_invariants() == []


def test_eviction_is_lazy_and_lru() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"a0", b"a1"], 0, 2)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [2, 3, 1, 0]
    # Reusing two blocks evicts nothing cached (blocks 2 and 3 had no hash).
    pool.get_new_blocks(2)
    assert pool.get_cached_block(b"a1") is a[1]
    # The next one comes from the head: block 1 (a1, freed first) is evicted before a0.
    (c,) = pool.get_new_blocks(1)
    assert c is a[1] and c.block_hash is None
    assert pool.get_cached_block(b"a1") is None
    assert pool.get_cached_block(b"a0") is a[0]
    assert pool.num_cached_free_blocks == 1
    assert pool.check_invariants() == []


def test_touch_pulls_free_block_out_and_counts_references() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"a0", b"a1"], 0, 2)
    pool.free_blocks(reversed(a))
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and free_ids(pool) == [2, 3, 1]
    pool.touch([a[0]])  # a second sharer: no queue change
    assert a[0].ref_cnt == 2 and free_ids(pool) == [2, 3, 1]
    pool.free_blocks([a[0]])
    assert a[0].ref_cnt == 1 and free_ids(pool) == [2, 3, 1]
    pool.free_blocks([a[0]])
    assert free_ids(pool) == [2, 3, 1, 0]
    assert pool.check_invariants() == []


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [b"same"], 0, 1)
    pool.cache_full_blocks(b, [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a[0]
    assert b[0].block_hash is None
    assert pool.check_invariants() == []


def test_reset_prefix_cache_only_when_everything_is_free() -> None:
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"x", b"y"], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"x") is a[0]
    pool.free_blocks(reversed(a))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"x") is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.statistics().num_cached_free_blocks == 0
    assert pool.check_invariants() == []


def test_caching_disabled_never_hashes() -> None:
    pool = BlockPool(2, enable_caching=False)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [b"x"], 0, 1)
    assert a[0].block_hash is None and pool.get_cached_block(b"x") is None


def test_check_invariants_reports_corruption() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    a[0].ref_cnt = 0  # leaked: neither free nor referenced
    assert any("neither free nor referenced" in p for p in pool.check_invariants())
    a[0].ref_cnt = 1
    pool.free_block_queue.get_all_free_blocks()[0].ref_cnt = 3
    assert any("free block" in p for p in pool.check_invariants())
    pool.blocks[2].ref_cnt = 0
    a[1].block_hash = b"ghost"
    assert any("hash the map does not hold" in p for p in pool.check_invariants())
    with pytest.raises(ValueError):
        BlockPool(0)
