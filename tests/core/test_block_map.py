"""BlockPool.block_states and group_block_states: the dashboard's view of the KV pool."""

from __future__ import annotations

import time

from vx.core.block_pool import BlockPool, group_block_states


def _pool_with_every_state() -> BlockPool:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(5)  # ids 0..4 in use
    pool.cache_full_blocks(blocks, [b"h0", b"h1", b"h2", b"h3", b"h4"], 0, 2)  # 0, 1 hashed
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])  # 0, 1 cached-free; 2 plain free
    return pool


def test_block_states_one_byte_per_block() -> None:
    pool = _pool_with_every_state()
    assert pool.block_states() == b"cc.uu..."
    stats = pool.statistics()
    states = pool.block_states()
    assert states.count(b"u") == stats.num_blocks - stats.num_free_blocks
    assert states.count(b"c") == stats.num_cached_free_blocks
    assert pool.check_invariants() == []


def test_group_block_states_small_pool_is_per_block() -> None:
    assert group_block_states(b"cc.uu...", 8) == (1, "cc.uu...")
    assert group_block_states(b"cc.uu...", 0) == (1, "cc.uu...")


def test_group_block_states_groups_with_shares_rounded_up() -> None:
    # 10 blocks into at most 3 cells: groups of 4, 4 and 2.
    group, cells = group_block_states(b"uuuu" + b"uc.." + b"..", 3)
    assert group == 4
    assert [cells[i : i + 2] for i in range(0, len(cells), 2)] == ["f0", "44", "00"]
    # One used block in a big group still shows (rounded up), a full group reads 15/15.
    group, cells = group_block_states(b"u" + b"." * 99 + b"c" * 100, 2)
    assert (group, cells) == (100, "10" + "0f")


def test_block_states_is_cheap_for_big_pools() -> None:
    pool = BlockPool(100_000)
    pool.get_new_blocks(30_000)
    t0 = time.perf_counter()
    group, cells = group_block_states(pool.block_states(), 16384)
    elapsed = time.perf_counter() - t0
    assert group == 25 and len(cells) == 2 * 4000  # at most max_groups (4096) cells
    assert cells[:2] == "f0" and cells[-2:] == "00"
    assert elapsed < 0.5  # about 6 ms here; generous for a loaded CI machine
