"""Paged attention over the block-table KV cache, and the per-step metadata it reads.

Runs in: each Worker process.

One flattened batch of T tokens mixes decodes (one query token each) and prefill chunks (which
may start after a cached prefix). The ModelRunner orders it **decodes first**: requests
``[0, num_decodes)`` have exactly one query token each, so their tokens are the contiguous
range ``[0, num_decodes)``; the prefill chunks follow. Every layer calls `paged_attention`,
which first writes the new K/V through `slot_mapping`, then attends through the block tables,
causally within each chunk, with grouped-query heads (GQA).

The KV layout is `vx.gpu.kv_cache`'s: ``[num_kv_heads, num_blocks, block_size, head_dim]``.

CPU path (no per-request Python loop for decodes):

- decodes: one call of a small C kernel (`vx.gpu.cpu.library`'s, compiled once per machine
  with the system C compiler and loaded with ctypes) reads every decode row's K/V straight from
  the paged cache, in fp32, parallel over (request, kv head) on torch's own OpenMP pool. Without
  a compiler (or with ``VX_CPU_ATTENTION_KERNEL=0``) a torch fallback gathers the blocks into a
  scratch buffer ``[Hkv, B, max_ctx, D]`` with one `index_select` and runs one SDPA with the G
  query heads of each kv head as the query rows;
- prefill chunks (bf16): every chunk of the step in one C call per layer, reading the cached
  prefix through the block table (`vx/gpu/cpu/csrc/prefill_amx.c` on AMX,
  `vx/gpu/cpu/csrc/prefill_avx2.c` on AVX2 CPUs without AVX-512). Elsewhere (fp32, other CPUs,
  ``VX_CPU_ATTENTION_KERNEL=portable``) per chunk one SDPA; a chunk with no cached prefix attends
  to its own new K/V with ``is_causal``, one with a prefix gathers its context from the cache
  and uses a precomputed offset-causal mask.

Everything that is the same for every layer (gather indices, masks, Triton tile maps) is built
once per step by `build_attention_metadata`. On CUDA `paged_attention` calls the Triton kernels
in `vx.gpu.attention.triton`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vx.config import BLOCK_SIZE
from vx.gpu.attention.metadata import AttentionMetadata, PrefillChunk
from vx.gpu.cpu.library import (
    cpu_decode_kernel_available,
    decode_kernel_fn,
    fast_decode_attention,
    load_cpu_kernels,
    prefill_kernel_available,
    set_cpu_decode_kernel,
)

__all__ = [
    "AttentionMetadata",
    "decode_kernel",
    "prefill_kernel",
    "PrefillChunk",
    "build_attention_metadata",
    "gather_blocks",
    "cpu_decode_kernel_available",
    "paged_attention",
    "set_cpu_decode_kernel",
    "write_kv_cache",
]


def build_attention_metadata(
    *,
    query_lens: np.ndarray,
    num_computed: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    num_decodes: int,
    device: torch.device | str = "cpu",
    block_size: int = BLOCK_SIZE,
    tile_block_m: int = 16,
    for_triton: bool | None = None,
    group_tables: Sequence[tuple[np.ndarray, np.ndarray]] = (),
) -> AttentionMetadata:
    """Build the metadata from per-request numpy arrays (vectorised; loops only over prefills).

    `block_table` is [R, >= blocks needed] (rows already gathered for these requests).
    `for_triton` (default: on CUDA) adds the Triton tile map; on CUDA the CPU-path fields
    are skipped. `group_tables`: the other KV-cache groups' (block table, slot mapping), same
    shapes; the result's `groups` then lists every group's metadata (this one first), which
    share everything but what the tables decide.
    """
    device = torch.device(device)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    num_computed = np.asarray(num_computed, dtype=np.int64)
    num_reqs = int(query_lens.shape[0])
    if num_decodes and np.any(query_lens[:num_decodes] != 1):
        raise ValueError("the first num_decodes requests must have query length 1")
    seq_lens = num_computed + query_lens
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    max_seq_len = int(seq_lens.max()) if num_reqs else 0
    num_blocks_used = -(-max_seq_len // block_size)
    tables = [(block_table, slot_mapping), *group_tables]
    bts = []
    for table, _ in tables:
        # the C kernels read these rows as given: a narrower table would be read past its rows
        if table.shape[1] < num_blocks_used:
            raise ValueError(f"block_table has {table.shape[1]} columns, {num_blocks_used} needed")
        bts.append(np.ascontiguousarray(table[:, :num_blocks_used], dtype=np.int32))

    md = AttentionMetadata(
        num_tokens=int(cu[-1]),
        num_reqs=num_reqs,
        num_decodes=num_decodes,
        slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device),
        query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(bts[0]).to(device),
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=max_seq_len,
        tile_block_m=tile_block_m,
    )
    if for_triton is None:
        for_triton = device.type == "cuda"
    if for_triton:
        # Triton: one program per (tile of tile_block_m query tokens of one request, q head).
        tiles_per_req = -(-query_lens // tile_block_m)
        tile_req = np.repeat(np.arange(num_reqs, dtype=np.int32), tiles_per_req)
        first_tile = np.cumsum(tiles_per_req) - tiles_per_req
        tile_idx = np.arange(tile_req.shape[0]) - np.repeat(first_tile, tiles_per_req)
        md.tile_req = torch.from_numpy(tile_req).to(device)
        md.tile_q_start = torch.from_numpy((tile_idx * tile_block_m).astype(np.int32)).to(device)
    mds = [md]
    for (_, sm), bt in zip(group_tables, bts[1:], strict=True):
        mds.append(
            dataclasses.replace(
                md,
                slot_mapping=torch.from_numpy(np.asarray(sm, dtype=np.int64)).to(device),
                block_table=torch.from_numpy(bt).to(device),
                prefills=[],
            )
        )
    if len(mds) > 1:
        md.groups = mds
    if device.type == "cuda":
        return md

    if num_decodes:
        dec_lens = seq_lens[:num_decodes]
        nblk = int(-(-dec_lens.max() // block_size))
        # Blocks past a row's length may hold anything (0 from the padding): they are masked.
        col = np.arange(nblk)[None, :]
        live = col * block_size < dec_lens[:, None]
        kernel = cpu_decode_kernel_available()
        if kernel:
            dec_seq_lens = torch.from_numpy(dec_lens.astype(np.int32))
        else:
            pos = torch.arange(nblk * block_size)
            mask = pos[None, :] < torch.from_numpy(dec_lens)[:, None]
            dec_mask = mask[None, :, None, :]
        for m, bt in zip(mds, bts, strict=True):
            ids = np.where(live, bt[:num_decodes, :nblk].astype(np.int64), 0)
            m.decode_num_blocks = nblk
            if kernel:
                m.decode_kernel = True
                m.decode_block_table = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int32))
                m.decode_seq_lens = dec_seq_lens
            else:
                m.decode_block_ids = torch.from_numpy(ids.reshape(-1))
                m.decode_mask = dec_mask
    for i in range(num_decodes, num_reqs):
        start, end, nc = int(cu[i]), int(cu[i + 1]), int(num_computed[i])
        if nc == 0:
            for m in mds:
                m.prefills.append(PrefillChunk(start, end, 0, None, None))
            continue
        ctx = nc + (end - start)
        nblk = -(-ctx // block_size)
        q_pos = torch.arange(nc, ctx)
        mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
        for m, bt in zip(mds, bts, strict=True):
            ids = torch.from_numpy(bt[i, :nblk].astype(np.int64))
            m.prefills.append(PrefillChunk(start, end, nc, ids, mask))
    if md.prefills and prefill_kernel_available():
        starts = torch.from_numpy(cu[num_decodes:num_reqs].astype(np.int32))
        lens = torch.from_numpy(query_lens[num_decodes:].astype(np.int32))
        computed = torch.from_numpy(num_computed[num_decodes:].astype(np.int32))
        for m, bt in zip(mds, bts, strict=True):
            m.prefill_starts, m.prefill_lens, m.prefill_computed = starts, lens, computed
            m.prefill_block_table = torch.from_numpy(np.ascontiguousarray(bt[num_decodes:]))
    return md


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v [T, Hkv, D] at their slots in the caches [Hkv, NB, BS, D] (CPU; head- or
    block-major, rows of D contiguous)."""
    hkv, nb, bs, d = k_cache.shape
    lib = load_cpu_kernels()
    if (
        lib is not None
        and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
        and k.stride(-1) == v.stride(-1) == 1
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and k_cache.stride(2) == d
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
    ):
        e = k.element_size()
        lib.vx_write_kv(
            k.data_ptr(), k.stride(0) * e, k.stride(1) * e,
            v.data_ptr(), v.stride(0) * e, v.stride(1) * e,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0) * e,
            k_cache.stride(1) * e, d * e, d * e, slot_mapping.data_ptr(), k.shape[0], hkv, bs,
            nb * bs,
        )  # fmt: skip
        return
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    k_cache[:, blocks, offsets] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache[:, blocks, offsets] = v.transpose(0, 1).to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    attn_metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into `kv_cache`, then attend: q [T, Hq, D] -> [T, Hq, D].

    `k`, `v` are [T, Hkv, D] for the same tokens; Hq must be a multiple of Hkv.
    """
    k_cache, v_cache = kv_cache
    if attn_metadata.groups is not None:
        attn_metadata = attn_metadata.for_cache(kv_cache)
    if q.is_cuda:
        from vx.gpu.attention import triton as triton_attention

        triton_attention.write_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
        return triton_attention.paged_attention(q, k_cache, v_cache, attn_metadata, scale)
    write_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
    md = attn_metadata
    out = q.new_empty(q.shape)
    if md.prefills and prefill_kernel(q, k_cache, v_cache, md, scale, out):
        pass
    elif not md.num_decodes and len(md.prefills) == 1:
        return _prefill_attention(q, k, v, k_cache, v_cache, md.prefills[0], scale)
    else:
        for chunk in md.prefills:
            out[chunk.start : chunk.end] = _prefill_attention(
                q, k, v, k_cache, v_cache, chunk, scale
            )
    if md.num_decodes:
        _decode_attention(q[: md.num_decodes], k_cache, v_cache, md, scale, out[: md.num_decodes])
    return out


def prefill_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> bool:
    """Every prefill chunk in one call of the C kernel (bf16: AMX, AVX512-BF16, or AVX2 without
    AVX-512), with a sliding `window` (keys; <= 0: none) and a logit `softcap` (<= 0: none);
    False: not taken here (nothing written)."""
    if (
        md.prefill_starts is None
        or q.dtype != torch.bfloat16
        or k_cache.dtype != torch.bfloat16
        or v_cache.dtype != torch.bfloat16
        or q.stride(-1) != 1
        or out.stride(-1) != 1
        or k_cache.stride(-1) != 1
        or v_cache.stride() != k_cache.stride()
    ):
        return False
    lib = load_cpu_kernels()
    assert lib is not None and md.prefill_block_table is not None
    assert md.prefill_lens is not None and md.prefill_computed is not None
    hkv, _, bs, d = k_cache.shape
    bt = md.prefill_block_table
    rc = lib.vx_prefill_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
        bt.data_ptr(), bt.stride(0), md.prefill_starts.data_ptr(), md.prefill_lens.data_ptr(),
        md.prefill_computed.data_ptr(), len(md.prefills), q.shape[1], hkv, d, bs, scale,
        window, softcap,
    )  # fmt: skip
    return rc == 0


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """All decode rows at once into `out` [B, Hq, D]: the C kernel, or a gather and one SDPA."""
    hkv, _, bs, d = k_cache.shape
    b, hq, _ = q.shape
    g = hq // hkv
    ctx = md.decode_num_blocks * bs
    if decode_kernel(q, k_cache, v_cache, md, scale, out):
        return
    if md.decode_kernel:
        _fill_fallback_fields(md, bs)
    assert md.decode_block_ids is not None and md.decode_mask is not None
    kbuf = md.scratch.get("decode_k")
    if kbuf is None or kbuf.dtype != k_cache.dtype or kbuf.shape[0] != hkv:
        shape = (hkv, md.decode_block_ids.shape[0], bs, d)
        kbuf = md.scratch["decode_k"] = k_cache.new_empty(shape)
        md.scratch["decode_v"] = v_cache.new_empty(shape)
    vbuf = md.scratch["decode_v"]
    gather_blocks(k_cache, md.decode_block_ids, out=kbuf)
    gather_blocks(v_cache, md.decode_block_ids, out=vbuf)
    # Query rows of one (kv head, request) batch entry are that kv head's G query heads.
    qg = q.view(b, hkv, g, d).transpose(0, 1)
    o = F.scaled_dot_product_attention(
        qg,
        kbuf.view(hkv, b, ctx, d),
        vbuf.view(hkv, b, ctx, d),
        attn_mask=md.decode_mask,
        scale=scale,
    )
    out.copy_(o.transpose(0, 1).reshape(b, hq, d))


def decode_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> bool:
    """The decode rows q [B, Hq, D] into `out` by one C kernel call (the fast kernel where it
    runs and takes the shape, else the portable one), with a sliding `window` and a logit
    `softcap` (<= 0: none); False: the kernel is not available for this step or dtype."""
    if not md.decode_kernel:
        return False
    fast = fast_decode_attention()
    fn = decode_kernel_fn(q.dtype, fast=fast)
    if fn is None or q.dtype != k_cache.dtype or q.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    hkv, _, bs, d = k_cache.shape
    b, hq, _ = q.shape
    bt, lens = md.decode_block_table, md.decode_seq_lens
    assert bt is not None and lens is not None
    args = (
        q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
        bt.data_ptr(), bt.stride(0), lens.data_ptr(),
        b, hq, hkv, d, bs, scale, md.decode_num_blocks * bs, window, softcap,
    )  # fmt: skip
    rc = fn(*args)
    if rc == -2 and fast:  # a shape the fast kernel does not handle
        rc = decode_kernel_fn(q.dtype)(*args)
    if rc != 0:
        raise MemoryError("the CPU decode attention kernel could not allocate scratch")
    return True


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`cache[:, block_ids]` as a contiguous ``[Hkv, n, BS, D]`` tensor, for a cache of
    either CPU layout (`vx.gpu.kv_cache`: head-major, or block-major seen as head-major).

    Why not `index_select(1, ...)` on the cache: on the block-major view (dim 1 is the
    outer dim of the memory) torch's index_select walks the whole cache (all of a 4 GiB pool
    for one layer's K), where gathering along the memory's own block axis copies only the
    selected blocks."""
    if cache.stride(1) > cache.stride(0):  # block-major: blocks are the memory's outer dim
        picked = cache.transpose(0, 1).index_select(0, block_ids).transpose(0, 1)
        return picked.contiguous() if out is None else out.copy_(picked)
    if out is None:
        return cache.index_select(1, block_ids)
    return torch.index_select(cache, 1, block_ids, out=out)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    """One chunk: causal over its own K/V, or over cached prefix + chunk with an offset mask."""
    s, e = chunk.start, chunk.end
    qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if chunk.block_ids is None:
        ks = k[s:e].transpose(0, 1).unsqueeze(0).to(q.dtype)
        vs = v[s:e].transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        hkv, _, bs, d = k_cache.shape
        ctx = chunk.num_computed + (e - s)
        ks = gather_blocks(k_cache, chunk.block_ids).view(hkv, -1, d)[:, :ctx]
        vs = gather_blocks(v_cache, chunk.block_ids).view(hkv, -1, d)[:, :ctx]
        o = F.scaled_dot_product_attention(
            qs,
            ks.unsqueeze(0).to(q.dtype),
            vs.unsqueeze(0).to(q.dtype),
            attn_mask=chunk.mask,
            scale=scale,
            enable_gqa=True,
        )
    return o[0].transpose(0, 1)


def _fill_fallback_fields(md: AttentionMetadata, block_size: int) -> None:
    """Build the torch-fallback fields from the kernel's (an unsupported dtype came along)."""
    if md.decode_block_ids is not None:
        return
    assert md.decode_block_table is not None and md.decode_seq_lens is not None
    md.decode_block_ids = md.decode_block_table.reshape(-1).long()
    pos = torch.arange(md.decode_num_blocks * block_size)
    md.decode_mask = (pos[None, :] < md.decode_seq_lens.long()[:, None])[None, :, None, :]
