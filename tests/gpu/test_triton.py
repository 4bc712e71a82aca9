"""The Triton kernels against their torch references, on CPU under TRITON_INTERPRET=1 (the
attention, norm and rotary kernels, and the fused-MoE experts)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

# The interpreter must be chosen before triton itself is imported (triton's own library
# functions are built at import in one mode or the other). When an earlier test module already
# imported triton in compiled mode, these tests run in a fresh subprocess instead.
_FRESH = "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
if "vx.gpu.attention.triton" in sys.modules:
    ta = importlib.reload(sys.modules["vx.gpu.attention.triton"])
else:
    ta = importlib.import_module("vx.gpu.attention.triton")
fresh = pytest.mark.skipif(not _FRESH, reason="triton imported compiled; run in a subprocess")
if "vx.gpu.layers.moe_kernel" in sys.modules:
    mk = importlib.reload(sys.modules["vx.gpu.layers.moe_kernel"])
else:
    mk = importlib.import_module("vx.gpu.layers.moe_kernel")

from vx.gpu.attention.paged import build_attention_metadata  # noqa: E402

BS = 16


def _paged_setup(reqs, hkv, d, dtype, seed=0):
    """Random caches, random block tables, and metadata for (num_computed, q_len) requests."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-(nc + n) // BS) for nc, n in reqs]
    num_blocks = sum(nblocks) + 3
    perm = rng.permutation(num_blocks)
    bt = np.zeros((len(reqs), max(nblocks) + 1), np.int32)
    off = 0
    for i, nb in enumerate(nblocks):
        bt[i, :nb] = perm[off : off + nb]
        off += nb
    k_cache = torch.randn(hkv, num_blocks, BS, d, generator=gen).to(dtype)
    v_cache = torch.randn(hkv, num_blocks, BS, d, generator=gen).to(dtype)
    slots = np.concatenate(
        [
            bt[i, np.arange(nc, nc + n) // BS] * BS + np.arange(nc, nc + n) % BS
            for i, (nc, n) in enumerate(reqs)
        ]
    )
    num_decodes = 0
    while num_decodes < len(reqs) and reqs[num_decodes][1] == 1:
        num_decodes += 1
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt,
        slot_mapping=slots,
        num_decodes=num_decodes,
        for_triton=True,
    )
    return k_cache, v_cache, md, gen


@fresh
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)]
)
@pytest.mark.parametrize(("hkv", "g", "d"), [(2, 3, 32), (1, 2, 24)])
def test_paged_attention_kernel(dtype, tol, hkv, g, d):
    reqs = [(0, 1), (37, 1), (16, 1), (0, 20), (17, 9), (32, 16)]
    k_cache, v_cache, md, gen = _paged_setup(reqs, hkv, d, dtype)
    q = torch.randn(md.num_tokens, hkv * g, d, generator=gen).to(dtype)
    out = ta.paged_attention(q, k_cache, v_cache, md, d**-0.5)
    ref = ta.paged_attention_ref(q, k_cache, v_cache, md, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@fresh
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (7, 0.0), (20, 5.0), (0, 5.0)])
def test_paged_attention_kernel_window_softcap(dtype, tol, window, softcap):
    """Sliding windows smaller than the contexts (inside a block, across blocks and query
    tiles) and Gemma 2's soft-cap; NaN in the blocks before every window (never read)."""
    reqs = [(0, 1), (37, 1), (16, 1), (0, 20), (17, 9), (40, 30)]
    k_cache, v_cache, md, gen = _paged_setup(reqs, 2, 32, dtype, seed=window)
    bt = md.block_table
    for i, (nc, _) in enumerate(reqs):
        for b in range(max(0, nc - window + 1) // BS if window > 0 else 0):
            k_cache[:, bt[i, b]] = torch.nan
            v_cache[:, bt[i, b]] = torch.nan
    q = torch.randn(md.num_tokens, 6, 32, generator=gen).to(dtype) * 3
    out = ta.paged_attention(q, k_cache, v_cache, md, 32**-0.5, window, softcap)
    ref = ta.paged_attention_ref(q, k_cache, v_cache, md, 32**-0.5, window, softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@fresh
def test_paged_attention_ref_matches_cpu_path():
    """The Triton reference and the CPU path agree (so both agree with the dense reference)."""
    from vx.gpu.attention.paged import paged_attention

    reqs = [(5, 1), (0, 1), (20, 12), (0, 7)]
    k_cache, v_cache, md, gen = _paged_setup(reqs, 2, 16, torch.float32, seed=3)
    q = torch.randn(md.num_tokens, 4, 16, generator=gen)
    # Write "new" K/V equal to what is already in the cache at their slots: a no-op write.
    flat_k = k_cache.reshape(2, -1, 16)  # copies where the cache is block-major
    flat_v = v_cache.reshape(2, -1, 16)
    k = flat_k[:, md.slot_mapping].transpose(0, 1).clone()
    v = flat_v[:, md.slot_mapping].transpose(0, 1).clone()
    out = paged_attention(q, k, v, (k_cache, v_cache), md, 0.25)
    ref = ta.paged_attention_ref(q, k_cache, v_cache, md, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@fresh
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_kernel(dtype):
    gen = torch.Generator().manual_seed(1)
    hkv, nb, d, t = 3, 6, 20, 11
    kc = torch.zeros(hkv, nb, BS, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    slots = torch.from_numpy(np.random.default_rng(1).permutation(nb * BS)[:t].astype(np.int64))
    slots[4] = -1  # padding: skipped
    ta.write_kv_cache(k, v, kc, vc, slots)
    ta.write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@fresh
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(dtype, with_residual):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(40, generator=gen)).to(dtype)
    res = torch.randn(5, 40, generator=gen).to(dtype) if with_residual else None
    got = ta.rms_norm(x, w, 1e-5, res)
    want = ta.rms_norm_ref(x, w, 1e-5, res)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    if with_residual:
        # The interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even), so
        # the bf16 residual may be one ulp off here; fp32 must be exact.
        exact = dtype == torch.float32
        torch.testing.assert_close(
            got[1], want[1], atol=0 if exact else 1e-2, rtol=0 if exact else 8e-3
        )
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@fresh
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_kernel(dtype):
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d, max_pos = 7, 6, 2, 32, 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.tensor([0, 5, 6, 63, 1, 2, 30])
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    want_q, want_k = ta.rotary_embedding_ref(positions, q, k, cos, sin)
    got_q, got_k = ta.rotary_embedding(positions, q.clone(), k.clone(), cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)


@fresh
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
def test_fused_moe_kernel(dtype, tol, tokens):
    """The grouped-GEMM experts against the torch reference: 8 experts top-2 (experts hit by
    many, one or no pairs), padding blocks, renormalised fp32 routing weights."""
    from vx.gpu.layers.fused_moe import moe_reference, select_experts

    e, k, h, i = 8, 2, 32, 48
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(tokens, e, generator=gen).to(dtype)
    weights, ids = select_experts(logits, k, renormalize=True, weights_in_fp32=True)
    got = mk.fused_experts(x, w13, w2, weights, ids)
    want = moe_reference(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_moe_align_pads_each_expert_to_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, block_expert = mk.align(ids, 4, 4)
    pairs = ids.numel()  # the sentinel
    assert sorted_ids.numel() % 4 == 0 and block_expert.numel() == sorted_ids.numel() // 4
    runs = sorted_ids.view(-1, 4)
    for b, expert in enumerate(block_expert.tolist()):
        live = [p for p in runs[b].tolist() if p < pairs]
        assert all(ids.view(-1)[p] == expert for p in live)
    assert sorted(p for p in sorted_ids.tolist() if p < pairs) == list(range(pairs))


def test_rms_norm_ref_matches_layers():
    """The reference is the model's own RMSNorm arithmetic."""
    layers = pytest.importorskip("vx.gpu.layers.linear")
    norm = layers.RMSNorm(24, 1e-6, dtype=torch.bfloat16, device=torch.device("cpu"))
    norm.weight.data.normal_()
    x = torch.randn(3, 24).bfloat16()
    r = torch.randn(3, 24).bfloat16()
    got = ta.rms_norm_ref(x, norm.weight, 1e-6, r)
    want = norm(x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(_FRESH, reason="the kernels ran in this process")
def test_kernels_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
