"""The C attention kernels with a sliding window and a logit soft-cap (`decode_kernel` and
`prefill_kernel` of `vx.gpu.attention.paged`, as `WindowedAttention` calls them) against a
fp32 reference of HF's eager attention, with windows smaller than the contexts (cutting
inside blocks, across the kernels' 16/32-key groups and 256-key chunks), and NaN in every
block wholly before a request's earliest window: a kernel that reads a key outside the window
fails (those blocks may have been freed and reused).

The paths: the fast decode kernel and the prefill kernel natively (AMX here where the CPU has
it), again with AMX off (the AVX512-BF16 items), the portable decode kernel (bf16 and fp32);
the emulated Sapphire Rapids runs this file too (tests/gpu/cpu/test_emulated_isa.py), and the
x86-64-v3 build's AVX2 kernels run `check_window_kernels` (tests/gpu/cpu/test_kernel_targets.py).

Runs in: the test process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.attention.test_paged_attention import BS, _scenario
from vx.gpu.attention.paged import (
    build_attention_metadata,
    decode_kernel,
    prefill_kernel,
    write_kv_cache,
)
from vx.gpu.attention.windowed import WindowedAttention
from vx.gpu.cpu import library
from vx.gpu.cpu.library import load_cpu_kernels

#: (num_computed, new tokens) per request, decodes first: contexts past a 256-key chunk
DECODES = [(0, 1), (16, 1), (40, 1), (299, 1), (530, 1)]
PREFILLS = [(0, 70), (100, 37), (290, 100), (5, 1 + 16)]


def _reference(q, hist_k, hist_v, reqs, g, scale, window, softcap):
    outs, off = [], 0
    for (nc, n), hk, hv in zip(reqs, hist_k, hist_v, strict=True):
        qq = q[off : off + n].float()
        off += n
        kk = hk.float().repeat_interleave(g, dim=1)
        vv = hv.float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qpos, kpos = torch.arange(nc, nc + n)[:, None], torch.arange(nc + n)[None, :]
        allowed = (kpos <= qpos) & (kpos > qpos - window if window > 0 else True)
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, -torch.inf).softmax(-1), vv))
    return torch.cat(outs).double()


def _run(reqs, num_decodes, hkv, g, d, window, softcap, dtype, seed):
    """(kernel output, reference, whether the kernel took every row)."""
    hist_k, hist_v, k_cache, v_cache, bt, q, k, v, slots = _scenario(seed, reqs, hkv, g, d, dtype)
    q = q * 3  # scores of a few units: the soft-cap bends them
    for i, (nc, _) in enumerate(reqs):
        first = max(0, nc - window + 1) if window > 0 else 0
        for b in range(first // BS):  # blocks no query of this request may read
            k_cache[:, bt[i, b]] = torch.nan
            v_cache[:, bt[i, b]] = torch.nan
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt, slot_mapping=slots, num_decodes=num_decodes,
    )  # fmt: skip
    write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
    scale, out = d**-0.5, torch.full_like(q, torch.nan)
    took = True
    if md.prefills:
        took &= prefill_kernel(q, k_cache, v_cache, md, scale, out, window, softcap)
    if num_decodes:
        nd = num_decodes
        took &= decode_kernel(q[:nd], k_cache, v_cache, md, scale, out[:nd], window, softcap)
    ref = _reference(q, hist_k, hist_v, reqs, g, scale, window, softcap)
    return out, ref, took


#: (window, softcap): one key, inside a block, across the 16/32-key groups and a 256-key
#: chunk, wider than every context (no cut), and none with a cap alone
WINDOWS = [(1, 0.0), (7, 20.0), (33, 0.0), (100, 5.0), (257, 0.0), (4096, 0.0), (0, 5.0)]
#: (hkv, g, d): GQA 3 at D 64 (AMX's 32-row prefill items), 2 at D 128 (its 16-row items)
SHAPES = [(2, 3, 64), (1, 2, 128)]


def check_window_kernels(prefill: bool = True) -> None:
    """Every (window, cap) and shape through whichever kernels the loaded library runs now,
    bf16, decodes and prefills in one step; asserts the kernels took the rows."""
    for hkv, g, d in SHAPES:
        for j, (window, cap) in enumerate(WINDOWS):
            reqs = DECODES + (PREFILLS if prefill else [])
            out, ref, took = _run(reqs, len(DECODES), hkv, g, d, window, cap, torch.bfloat16, j)
            assert took, (window, cap, d)
            err = (out.double() - ref).abs() - 2e-2 * (1 + ref.abs())
            assert (err <= 0).all(), (window, cap, d, err.max().item())  # NaN fails too


@pytest.fixture(params=["native", "amx-off", "portable"])
def kernels(request):
    """The fast kernels as this CPU runs them, with AMX turned off (where it is on), and the
    portable decode kernel (no prefill kernel then: decodes only)."""
    lib = load_cpu_kernels()
    if lib is None:
        pytest.skip(f"no kernel library here: {library.kernel_build_error()}")
    if request.param == "portable":
        library.set_fast_decode_attention(False)
        try:
            yield request.param
        finally:
            library.set_fast_decode_attention(None)
        return
    if not library.prefill_kernel_available():
        pytest.skip("no C prefill kernel on this CPU")
    if request.param == "native":
        yield request.param
        return
    if not hasattr(lib, "vx_fast_amx") or not lib.vx_fast_amx(-1):
        pytest.skip("no AMX here: the native run is the one without it")
    lib.vx_fast_amx(0)
    try:
        yield request.param
    finally:
        lib.vx_fast_amx(1)


@pytest.mark.timeout(120)
def test_window_kernels_match_reference(kernels) -> None:
    check_window_kernels(prefill=kernels != "portable")


@pytest.mark.timeout(60)
def test_fp32_decode_kernel_windows() -> None:
    """fp32 decodes take the portable kernel with the window (fp32 prefills stay in torch)."""
    if load_cpu_kernels() is None:
        pytest.skip("no kernel library here")
    for j, (window, cap) in enumerate(WINDOWS):
        out, ref, took = _run(DECODES, len(DECODES), 2, 3, 48, window, cap, torch.float32, j)
        assert took
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(60)
def test_windowed_attention_routes_to_the_kernels(monkeypatch) -> None:
    """`WindowedAttention` on CPU bf16 hands its rows to the kernels (the torch loop, which
    would read the NaN blocks through its gather only if it ran, is not called)."""
    if not library.prefill_kernel_available():
        pytest.skip("no C prefill kernel on this CPU")
    reqs = DECODES + PREFILLS
    hist_k, hist_v, k_cache, v_cache, bt, q, k, v, slots = _scenario(5, reqs, 2, 3, 64,
                                                                      torch.bfloat16)  # fmt: skip
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt, slot_mapping=slots, num_decodes=len(DECODES),
    )  # fmt: skip
    attn = WindowedAttention(33, 10.0)

    def no_torch(*a, **kw):
        raise AssertionError("the torch path ran")

    monkeypatch.setattr(attn, "_request", no_torch)
    out = attn(q, k, v, (k_cache, v_cache), md, 0.125)
    ref = _reference(q, hist_k, hist_v, reqs, 3, 0.125, 33, 10.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
