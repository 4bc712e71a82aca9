"""The C prefill attention (bf16, every chunk of a step in one call: on AMX, on AVX512-BF16
without AMX (also run on AMX machines with the tiles turned off), or the AVX2 kernel on AVX2
CPUs without AVX-512): it must match
SDPA over the same K/V, causal within each chunk, after a cached prefix or not, with decodes
in the same batch, and hand back to SDPA where it does not apply.

Runs in: the test process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vx.gpu.attention import paged as attention
from vx.gpu.attention.paged import build_attention_metadata, paged_attention
from vx.gpu.cpu.library import load_cpu_kernels, prefill_kernel_available


@pytest.fixture(params=["native", "amx-off"])
def kernel(request):
    if not prefill_kernel_available():
        pytest.skip("no C prefill kernel on this machine (AVX-512 BF16, or AVX2 without AVX-512)")
    lib = load_cpu_kernels()
    if request.param == "native":
        yield lib
        return
    # The AVX512-BF16 items without AMX, on a machine that has AMX: tiles off for the test.
    # (AVX2 builds have no AMX switch at all.)
    if not hasattr(lib, "vx_fast_amx") or not lib.vx_fast_amx(-1):
        pytest.skip("no AMX here: the native run is the one without it")
    lib.vx_fast_amx(0)
    try:
        assert lib.vx_has_prefill_attention() == 3
        yield lib
    finally:
        lib.vx_fast_amx(1)


def _reference(q, k_all, v_all, nc, n, scale, hq, hkv):
    """fp32 SDPA of n queries at positions [nc, nc + n) over keys [0, nc + n)."""
    ctx = nc + n
    qs = q.float().transpose(0, 1).unsqueeze(0)
    ks = k_all[:ctx].float().transpose(0, 1).unsqueeze(0)
    vs = v_all[:ctx].float().transpose(0, 1).unsqueeze(0)
    mask = torch.arange(ctx)[None, :] <= torch.arange(nc, ctx)[:, None]
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


CASES = [
    # (hq, hkv, d, block size, decodes, [(cached, new) per chunk])
    (9, 3, 64, 16, 0, [(0, 128)]),
    (9, 3, 64, 16, 0, [(0, 1), (0, 7), (0, 16), (0, 17), (0, 33), (0, 300)]),
    (9, 3, 64, 16, 2, [(32, 7), (48, 100), (0, 50)]),  # prefix hits and decodes
    (9, 3, 64, 16, 0, [(0, 700)]),  # past several 256-key chunks: the online rescale
    (9, 3, 64, 16, 0, [(500, 40), (256, 1)]),  # a short chunk after a long prefix
    (4, 2, 32, 16, 0, [(0, 70), (16, 20)]),
    (8, 8, 128, 16, 1, [(0, 90), (20, 300)]),
    (6, 2, 96, 16, 0, [(0, 45), (10, 260)]),
    (16, 2, 256, 16, 0, [(0, 40), (5, 33)]),
    (9, 3, 64, 8, 0, [(3, 61), (0, 19)]),  # blocks smaller than 16 keys
    (9, 3, 64, 32, 0, [(40, 41)]),
    # query heads per item (D <= 64: up to 4 of a kv head's together): 8 = 4 + 4, 5 = 3 + 2, 1
    (16, 2, 64, 16, 0, [(0, 70), (30, 40)]),
    (10, 2, 32, 16, 1, [(0, 65), (7, 300)]),
    (4, 4, 64, 16, 0, [(0, 33)]),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "bs", "decodes", "chunks"), CASES)
def test_prefill_kernel_matches_sdpa(kernel, monkeypatch, hq, hkv, d, bs, decodes, chunks) -> None:
    monkeypatch.setattr(attention, "_prefill_attention", None)  # the kernel must take them all
    g = torch.Generator().manual_seed(hq * 1000 + d + bs + len(chunks))
    reqs = [(24 + 3 * i, 1) for i in range(decodes)] + chunks  # (cached, new)
    nblk = [-(-(nc + n) // bs) for nc, n in reqs]
    num_blocks = sum(nblk) + 5
    perm = torch.randperm(num_blocks, generator=g).numpy()  # scattered blocks
    table = np.zeros((len(reqs), max(nblk)), dtype=np.int32)
    used = 0
    for i, b in enumerate(nblk):
        table[i, :b] = perm[used : used + b]
        used += b
    # Every request's whole context in token order; the cached part goes into the cache now,
    # the new part is written by paged_attention itself.
    ctx_k = [torch.randn(nc + n, hkv, d, generator=g).bfloat16() for nc, n in reqs]
    ctx_v = [torch.randn(nc + n, hkv, d, generator=g).bfloat16() for nc, n in reqs]
    k_cache = torch.randn(hkv, num_blocks, bs, d, generator=g).bfloat16()  # stale data
    v_cache = torch.randn(hkv, num_blocks, bs, d, generator=g).bfloat16()
    slots = []
    for i, (nc, n) in enumerate(reqs):
        for p in range(nc + n):
            slot = int(table[i, p // bs]) * bs + p % bs
            if p < nc:
                k_cache.view(hkv, -1, d)[:, slot] = ctx_k[i][p]
                v_cache.view(hkv, -1, d)[:, slot] = ctx_v[i][p]
            else:
                slots.append(slot)
    q = torch.randn(sum(n for _, n in reqs), hq, d, generator=g).bfloat16()
    k = torch.cat([ctx_k[i][nc:] for i, (nc, _) in enumerate(reqs)])
    v = torch.cat([ctx_v[i][nc:] for i, (nc, _) in enumerate(reqs)])
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=table,
        slot_mapping=np.array(slots),
        num_decodes=decodes,
        block_size=bs,
    )
    assert md.prefill_starts is not None
    scale = d**-0.5
    out = paged_attention(q, k, v, (k_cache, v_cache), md, scale)
    start = 0
    for i, (nc, n) in enumerate(reqs):
        ref = _reference(q[start : start + n], ctx_k[i], ctx_v[i], nc, n, scale, hq, hkv)
        got = out[start : start + n].float()
        # AMX: P is rounded to bf16 before P V (as torch's flash attention does for bf16)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        start += n


def test_prefill_kernel_matches_torch_flash_closely(kernel) -> None:
    """Against SDPA in bf16 (what the kernel replaces): within a bf16 ulp or two."""
    g = torch.Generator().manual_seed(7)
    n, hq, hkv, d, bs = 200, 9, 3, 64, 16
    nb = -(-n // bs)
    table = np.arange(nb, dtype=np.int32)[None, :]
    q = torch.randn(n, hq, d, generator=g).bfloat16()
    k = torch.randn(n, hkv, d, generator=g).bfloat16()
    v = torch.randn(n, hkv, d, generator=g).bfloat16()
    caches = (torch.zeros(hkv, nb, bs, d).bfloat16(), torch.zeros(hkv, nb, bs, d).bfloat16())
    md = build_attention_metadata(
        query_lens=np.array([n]), num_computed=np.array([0]), block_table=table,
        slot_mapping=np.arange(n), num_decodes=0,
    )  # fmt: skip
    out = paged_attention(q, k, v, caches, md, 0.125)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=0.125, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    diff = (out.float() - ref.float()).abs()
    assert diff.max() <= 1.6e-2, diff.max()
    assert diff.mean() <= 1e-3, diff.mean()


def test_fp32_and_declined_shapes_use_sdpa(kernel, monkeypatch) -> None:
    """fp32 never reaches the kernel; a shape it declines (D % 8: both kernels) falls back to
    SDPA."""
    calls = []
    real = attention._prefill_attention
    monkeypatch.setattr(attention, "_prefill_attention", lambda *a: calls.append(1) or real(*a))
    for dtype, d in ((torch.float32, 64), (torch.bfloat16, 12)):
        calls.clear()
        n, hq, hkv, bs = 20, 4, 2, 16
        q = torch.randn(n, hq, d).to(dtype)
        k, v = torch.randn(n, hkv, d).to(dtype), torch.randn(n, hkv, d).to(dtype)
        caches = (torch.zeros(hkv, 2, bs, d).to(dtype), torch.zeros(hkv, 2, bs, d).to(dtype))
        md = build_attention_metadata(
            query_lens=np.array([n]), num_computed=np.array([0]),
            block_table=np.array([[0, 1]], dtype=np.int32), slot_mapping=np.arange(n),
            num_decodes=0,
        )  # fmt: skip
        out = paged_attention(q, k, v, caches, md, d**-0.5)
        assert calls == [1]
        ref = _reference(q, k, v, 0, n, d**-0.5, hq, hkv)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
