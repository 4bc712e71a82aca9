"""`vx.gpu.kv_cache.kv_cache_groups`: layers grouped by kind into groups of equal size (the
layout a hybrid KV cache's one pool relies on), and the layers' caches over shared slots."""

from __future__ import annotations

import torch

from vx.gpu.kv_cache import GroupKVCache, allocate_kv_caches, kv_cache_groups, layer_caches


def test_one_kind_is_one_group() -> None:
    g = kv_cache_groups([None] * 4)
    assert (g.windows, g.group_size, g.layer_slot) == ((None,), 4, (0, 1, 2, 3))
    assert kv_cache_groups([512] * 3).windows == (512,)


def test_gemma_layouts() -> None:
    # Gemma 2: alternating; two groups of two layers, the global one first
    g = kv_cache_groups([4096, None, 4096, None])
    assert g.windows == (None, 4096) and g.group_size == 2
    assert g.layer_group == (1, 0, 1, 0) and g.layer_slot == (0, 0, 1, 1)
    # Gemma 3: five windowed, one global; groups of one layer
    g = kv_cache_groups([512] * 5 + [None])
    assert g.windows == (None,) + (512,) * 5 and g.group_size == 1
    assert g.layer_group == (1, 2, 3, 4, 5, 0) and set(g.layer_slot) == {0}
    # 26 layers, a global one every sixth: 4 global, 22 windowed in groups of 4 (last of 2)
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    g = kv_cache_groups(windows)
    assert g.group_size == 4 and g.windows == (None,) + (512,) * 6
    pairs = {(g.layer_group[i], g.layer_slot[i]) for i in range(26)}
    assert len(pairs) == 26  # no two layers share a (group, slot)


def test_layer_caches_share_slots() -> None:
    g = kv_cache_groups([8, None, 8, None])
    slots = allocate_kv_caches(g.group_size, 3, 1, 4, dtype=torch.float32, device="cpu")
    caches = layer_caches(slots, g, 0, 4)
    assert all(isinstance(c, GroupKVCache) for c in caches)
    assert [c.group for c in caches] == [1, 0, 1, 0]
    assert caches[0][0] is slots[0][0] and caches[1][0] is slots[0][0]
    assert caches[2][1] is slots[1][1]
    k, v = caches[3]  # unpacks as a (K, V) pair
    assert k is slots[1][0] and v is slots[1][1]
    one = kv_cache_groups([None, None])
    assert layer_caches(slots, one, 0, 2) is slots


def test_metadata_per_group_shares_all_but_the_tables() -> None:
    import numpy as np

    from vx.gpu.attention.paged import build_attention_metadata

    t0 = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int32)
    t1 = np.array([[6, 7, 8], [9, 10, 11]], dtype=np.int32)
    md = build_attention_metadata(
        query_lens=np.array([1, 5]), num_computed=np.array([20, 30]), block_table=t0,
        slot_mapping=np.array([20, 78]), num_decodes=1, group_tables=[(t1, np.array([116, 174]))],
    )  # fmt: skip
    assert md.groups is not None and md.groups[0] is md and md.groups[1].groups is None
    g1 = md.groups[1]
    assert g1.slot_mapping.tolist() == [116, 174] and g1.block_table.tolist() == t1.tolist()
    assert g1.seq_lens is md.seq_lens and g1.query_start_loc is md.query_start_loc
    assert len(g1.prefills) == len(md.prefills) == 1
    assert g1.prefills[0].block_ids.tolist() == [9, 10, 11]
    assert md.prefills[0].block_ids.tolist() == [3, 4, 5]
    if md.decode_kernel:
        assert g1.decode_block_table.tolist() == [[6, 7]]
    assert md.for_cache(GroupKVCache(torch.zeros(1), torch.zeros(1), 1)) is g1
