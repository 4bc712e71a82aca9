"""The CPU paged attention path against a naive dense reference, and the KV pool sizing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.gpu.attention import paged as attention
from vx.gpu.attention.paged import build_attention_metadata, paged_attention, write_kv_cache
from vx.gpu.kv_cache import allocate_kv_caches, block_bytes, num_cpu_blocks, num_gpu_blocks

BS = 16


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request):
    """Run a test with the C decode kernel and with the torch fallback."""
    attention.set_cpu_decode_kernel(request.param == "kernel")
    if request.param == "kernel" and not attention.cpu_decode_kernel_available():
        attention.set_cpu_decode_kernel(None)
        pytest.skip("no C compiler: the CPU decode kernel is unavailable")
    yield request.param
    attention.set_cpu_decode_kernel(None)


def _scenario(
    seed: int, reqs: list[tuple[int, int]], hkv: int, g: int, d: int, dtype, table_seed=None
):
    """reqs: (num_computed, q_len) per request, decodes (q_len == 1) first.

    Returns the dense history per request, a filled cache, block tables and the new q/k/v.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed if table_seed is None else table_seed)
    nblocks = [-(-(nc + n) // BS) for nc, n in reqs]
    num_blocks = sum(nblocks) + 5
    perm = rng.permutation(num_blocks)
    tables, off = [], 0
    for nb in nblocks:
        tables.append(perm[off : off + nb])
        off += nb
    width = max(nblocks) + 2
    bt = np.full((len(reqs), width), 7, dtype=np.int32)  # stale ids past each row's blocks
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    (k_cache, v_cache) = allocate_kv_caches(1, num_blocks, hkv, d, dtype=dtype, device="cpu")[0]
    # Garbage in unused slots must not leak into results (masked out).
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    hist_k, hist_v = [], []
    for (nc, n), t in zip(reqs, tables, strict=True):
        hk = torch.randn(nc + n, hkv, d, generator=gen).to(dtype)
        hv = torch.randn(nc + n, hkv, d, generator=gen).to(dtype)
        hist_k.append(hk)
        hist_v.append(hv)
        if nc:
            pos = np.arange(nc)
            slots = torch.from_numpy(t[pos // BS].astype(np.int64) * BS + pos % BS)
            write_kv_cache(hk[:nc], hv[:nc], k_cache, v_cache, slots)
    q = torch.cat([torch.randn(n, hkv * g, d, generator=gen) for _, n in reqs]).to(dtype)
    k = torch.cat([hk[nc:] for hk, (nc, _) in zip(hist_k, reqs, strict=True)])
    v = torch.cat([hv[nc:] for hv, (nc, _) in zip(hist_v, reqs, strict=True)])
    slots = np.concatenate(
        [
            t[np.arange(nc, nc + n) // BS] * BS + np.arange(nc, nc + n) % BS
            for (nc, n), t in zip(reqs, tables, strict=True)
        ]
    )
    return hist_k, hist_v, k_cache, v_cache, bt, q, k, v, slots


def _dense_reference(q, hist_k, hist_v, reqs, g, scale):
    outs, off = [], 0
    for (nc, n), hk, hv in zip(reqs, hist_k, hist_v, strict=True):
        qq = q[off : off + n].double()
        off += n
        kk = hk.double().repeat_interleave(g, dim=1)  # [ctx, Hq, D]
        vv = hv.double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        qpos = torch.arange(nc, nc + n)[:, None]
        s = s.masked_fill(torch.arange(nc + n)[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


MIXED = [(0, 1), (40, 1), (16, 1), (95, 1), (0, 23), (16, 7), (33, 40), (5, 1 + 16)]


@pytest.mark.parametrize(
    ("reqs", "num_decodes"),
    [
        (MIXED, 4),
        ([(0, 50)], 0),  # one plain prefill
        ([(31, 1), (1, 1), (200, 1)], 3),  # decodes only
        ([(48, 16), (7, 33)], 0),  # prefills after a cached prefix only
    ],
)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("hkv", "g", "d"), [(2, 3, 32), (1, 4, 64), (3, 1, 16)])
def test_paged_attention_matches_dense(reqs, num_decodes, dtype, tol, hkv, g, d, decode_path):
    hist_k, hist_v, k_cache, v_cache, bt, q, k, v, slots = _scenario(
        len(reqs) * 7 + d, reqs, hkv, g, d, dtype
    )
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt,
        slot_mapping=slots,
        num_decodes=num_decodes,
    )
    scale = d**-0.5
    out = paged_attention(q, k, v, (k_cache, v_cache), md, scale)
    ref = _dense_reference(q, hist_k, hist_v, reqs, g, scale)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The new K/V landed at their slots.
    flat_k = k_cache.reshape(hkv, -1, d)  # a copy where the cache is block-major
    torch.testing.assert_close(
        flat_k[:, torch.from_numpy(slots)], k.transpose(0, 1), atol=0, rtol=0
    )


def test_metadata_is_shared_across_layers(decode_path):
    """Two layers with their own caches reuse one metadata (and its scratch buffers)."""
    reqs = [(20, 1), (3, 1), (10, 5)]
    md = None
    for seed in (1, 2):
        hk, hv, kc, vc, bt, q, k, v, slots = _scenario(
            seed, reqs, 2, 2, 16, torch.float32, table_seed=0
        )
        if md is None:
            md = build_attention_metadata(
                query_lens=np.array([1, 1, 5]),
                num_computed=np.array([20, 3, 10]),
                block_table=bt,
                slot_mapping=slots,
                num_decodes=2,
            )
        out = paged_attention(q, k, v, (kc, vc), md, 0.25)
        ref = _dense_reference(q, hk, hv, reqs, 2, 0.25)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert md.decode_kernel == (decode_path == "kernel")
    assert ("decode_k" in md.scratch) == (decode_path == "torch")


def test_decode_kernel_falls_back_for_other_dtypes(decode_path):
    """fp16 has no C kernel: the same metadata serves the torch fallback."""
    reqs = [(20, 1), (3, 1)]
    hist_k, hist_v, kc, vc, bt, q, k, v, slots = _scenario(9, reqs, 2, 2, 16, torch.float16)
    md = build_attention_metadata(
        query_lens=np.array([1, 1]),
        num_computed=np.array([20, 3]),
        block_table=bt,
        slot_mapping=slots,
        num_decodes=2,
    )
    out = paged_attention(q, k, v, (kc, vc), md, 0.25)
    ref = _dense_reference(q, hist_k, hist_v, reqs, 2, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_build_metadata_rejects_misordered_decodes():
    with pytest.raises(ValueError, match="query length 1"):
        build_attention_metadata(
            query_lens=np.array([2, 1]),
            num_computed=np.array([0, 3]),
            block_table=np.zeros((2, 2), np.int32),
            slot_mapping=np.arange(3),
            num_decodes=1,
        )


# ───────────────────────────── KV pool sizing ─────────────────────────────


def test_num_gpu_blocks_seed_example():
    """Llama 3.1 8B on an 80 GB H100 at 0.92: 27,436 blocks, 439K tokens, 107 x 4,096."""
    per_block = block_bytes(32, 8, 128, torch.bfloat16)
    assert per_block == 2 * 1024**2
    weights = 8_030_261_248 * 2  # "16.06 GB"
    n = num_gpu_blocks(80 * 10**9, 0.92, weights, 0, per_block)
    assert n == 27_436
    assert n * BS == 438_976
    assert n * BS // 4096 == 107


def test_num_gpu_blocks_edges():
    assert num_gpu_blocks(10**9, 0.5, 6 * 10**8, 0, 1024) == 0  # nothing left: 0, not negative
    assert num_gpu_blocks(10**9, 1.0, 0, 10**8, 10**6) == 900
    with pytest.raises(ValueError):
        num_gpu_blocks(10**9, 1.0, 0, 0, 0)


def test_num_cpu_blocks():
    per_block = block_bytes(30, 3, 64, torch.bfloat16)  # SmolLM2-135M
    assert per_block == 2 * 30 * 3 * 64 * 16 * 2
    assert num_cpu_blocks(4 * 1024**3, per_block) == (4 * 1024**3) // per_block
    assert block_bytes(2, 1, 8, torch.float32) == 2 * 2 * 8 * 16 * 4


@pytest.mark.parametrize("layout", ["block", "head"])
@pytest.mark.parametrize("use_out", [False, True])
def test_gather_blocks_picks_whole_blocks_in_either_layout(monkeypatch, layout, use_out):
    """gather_blocks(cache, ids) is cache[:, ids], contiguous, for head- and block-major
    caches alike (the block-major one gathers along its memory's block axis)."""
    monkeypatch.setenv("VX_KV_LAYOUT", layout)
    hkv, nb, d = 3, 40, 8
    ((k_cache, _),) = allocate_kv_caches(1, nb, hkv, d, dtype=torch.float32, device="cpu")
    assert (k_cache.stride(1) > k_cache.stride(0)) == (layout == "block")
    k_cache.copy_(torch.randn(k_cache.shape, generator=torch.Generator().manual_seed(3)))
    ids = torch.tensor([7, 0, 39, 7, 12])
    out = torch.full((hkv, len(ids), BS, d), float("nan")) if use_out else None
    got = attention.gather_blocks(k_cache, ids, out=out)
    assert got.is_contiguous() and got.shape == (hkv, len(ids), BS, d)
    torch.testing.assert_close(got, k_cache[:, ids], atol=0, rtol=0)
    if use_out:
        assert got.data_ptr() == out.data_ptr()
