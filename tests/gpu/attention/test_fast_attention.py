"""The fast CPU decode attention kernels (`set_fast_decode_attention`, the default for bf16;
`VX_CPU_ATTENTION_KERNEL=portable` at the library's load turns them off): AVX512-BF16 (and
AMX), or AVX2 where the CPU has no AVX-512. Each must match an fp32 reference like the
portable kernel does.

Runs in: the test process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.gpu.attention.paged import build_attention_metadata, paged_attention
from vx.gpu.cpu import library
from vx.gpu.cpu.library import (
    decode_kernel_fn,
    fast_decode_attention,
    load_cpu_kernels,
    prefill_kernel_available,
    set_fast_decode_attention,
    set_work_stealing,
)


def _has_fast() -> bool:
    lib = load_cpu_kernels()
    return lib is not None and decode_kernel_fn(torch.bfloat16, fast=True) is not decode_kernel_fn(
        torch.bfloat16
    )


@pytest.fixture(autouse=True)
def _reset():
    yield
    set_fast_decode_attention(None)


def test_the_fast_kernel_is_the_default_and_chosen_once(monkeypatch) -> None:
    """``VX_CPU_ATTENTION_KERNEL`` picks the kernels once; a later change of the environment
    does not switch them mid-run. `set_fast_decode_attention(None)` decides again (as a new
    process would), a bool overrides."""
    monkeypatch.delenv("VX_CPU_ATTENTION_KERNEL", raising=False)
    set_fast_decode_attention(None)
    assert fast_decode_attention()
    monkeypatch.setenv("VX_CPU_ATTENTION_KERNEL", "portable")
    assert fast_decode_attention()  # decided already
    set_fast_decode_attention(None)
    assert not fast_decode_attention()
    monkeypatch.setenv("VX_CPU_ATTENTION_KERNEL", "fast")
    set_fast_decode_attention(None)
    assert fast_decode_attention()
    set_fast_decode_attention(False)
    assert not fast_decode_attention()


def test_the_library_load_decides_the_kernels(monkeypatch) -> None:
    """The load reads ``VX_CPU_ATTENTION_KERNEL`` for both the library and its attention
    kernels: ``portable`` at the load keeps the portable kernel after the variable changes."""
    monkeypatch.setattr(library, "_kernel_state", {})
    monkeypatch.setattr(library, "_fast_state", {})
    monkeypatch.setenv("VX_CPU_ATTENTION_KERNEL", "portable")
    if load_cpu_kernels() is None:
        pytest.skip(f"no kernel library here: {library.kernel_build_error()}")
    monkeypatch.setenv("VX_CPU_ATTENTION_KERNEL", "fast")
    assert not fast_decode_attention()
    assert not prefill_kernel_available()


CASES = [
    # (hq, hkv, d, block size, lens): GQA groups 1/3/4/8, D 32..256, lengths 1, not multiples
    # of 16, and past one 256-key chunk (the online softmax's rescaling path)
    (9, 3, 64, 16, [1, 17, 200, 64, 33]),
    (4, 2, 32, 16, [1, 17, 200, 64, 33]),
    (8, 8, 128, 16, [1, 17, 200, 64, 33]),
    (4, 2, 16, 16, [1, 17, 200, 64, 33]),  # D % 32: the fast kernel declines, portable runs
    (4, 1, 64, 16, [1, 2, 15, 16, 31, 257]),
    (8, 1, 128, 16, [700, 1, 513]),
    (9, 3, 64, 16, [1000, 255, 256, 511, 3]),
    (6, 2, 96, 16, [40, 300]),
    (16, 2, 256, 16, [19, 290]),
    (9, 3, 64, 8, [1, 9, 100, 300]),  # a block smaller than the 16-key groups
    (9, 3, 64, 8, [5, 1100, 3]),  # next-item prefetch capped at 64 blocks (of 8 keys)
    (9, 3, 64, 32, [5, 33, 270]),
]


@pytest.fixture(params=[False, True], ids=["vector", "amx"])
def amx(request):
    """The fast kernel: AVX512-BF16 (its q.k with vector dot products or with AMX tiles, where
    the CPU has them), or on an AVX2 CPU without AVX-512 the AVX2 kernel."""
    lib = load_cpu_kernels()
    if not _has_fast():
        pytest.skip("no AVX512-BF16 or AVX2 kernel on this machine")
    if not lib.vx_has_fast_bf16():  # the AVX2 kernel: no AMX variant
        if request.param:
            pytest.skip("no AMX on this machine")
        yield False
        return
    before = lib.vx_fast_amx(-1)
    if lib.vx_fast_amx(int(request.param)) != int(request.param):
        pytest.skip("no AMX on this machine")
    yield request.param
    lib.vx_fast_amx(before)


@pytest.mark.parametrize(("hq", "hkv", "d", "bs", "lens"), CASES)
def test_fast_decode_matches_reference(
    hq: int, hkv: int, d: int, bs: int, lens: list, amx: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    lens = np.array(lens)
    b = len(lens)
    width = -(-int(lens.max()) // bs)
    nb = b * width + 3
    kc = torch.randn(hkv, nb, bs, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(hkv, nb, bs, d, generator=g).to(torch.bfloat16)
    # a few large keys: the softmax max moves between chunks
    kc[:, :: max(nb // 5, 1), 3] *= 4
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(nb, generator=g).numpy()
    table = perm[: b * width].reshape(b, width).astype(np.int32)
    # this step's token (the last position) is written to its slot by paged_attention
    last = lens - 1
    slots = table[np.arange(b), last // bs].astype(np.int64) * bs + last % bs
    k_new = torch.randn(b, hkv, d, generator=g).to(torch.bfloat16)
    v_new = torch.randn(b, hkv, d, generator=g).to(torch.bfloat16)
    md = build_attention_metadata(
        query_lens=np.ones(b, dtype=np.int64), num_computed=lens - 1, block_table=table,
        slot_mapping=slots, num_decodes=b, block_size=bs,
    )  # fmt: skip
    scale = d**-0.5
    outs = {}
    for fast in (False, True):
        set_fast_decode_attention(fast)
        outs[fast] = paged_attention(q, k_new, v_new, (kc, vc), md, scale)
    refs = []
    for i, n in enumerate(lens.tolist()):
        blocks = torch.from_numpy(table[i].astype(np.int64))
        k = kc[:, blocks].reshape(hkv, -1, d)[:, :n].float()
        v = vc[:, blocks].reshape(hkv, -1, d)[:, :n].float()
        qq = q[i].float().view(hkv, hq // hkv, d)
        refs.append((torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(hq, d))
        for fast, out in outs.items():
            torch.testing.assert_close(out[i].float(), refs[i], atol=2e-2, rtol=2e-2, msg=str(fast))
    diff = (outs[True].float() - outs[False].float()).abs()
    if d % 32 == 0:  # the fast kernel handles this shape itself (no -2 fallback)
        out = torch.empty_like(q)
        args = (
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3], md.decode_block_table.data_ptr(),
            md.decode_block_table.stride(0), md.decode_seq_lens.data_ptr(),
            b, hq, hkv, d, bs, scale, md.decode_num_blocks * bs, 0, 0.0,
        )  # fmt: skip
        assert decode_kernel_fn(torch.bfloat16, fast=True)(*args) == 0
        assert torch.equal(out, outs[True])
        # items handed out by stealing (most ranges ownerless in mode 5): the same bits
        try:
            for mode in (0, 5):
                set_work_stealing(mode)
                out.zero_()
                assert decode_kernel_fn(torch.bfloat16, fast=True)(*args) == 0
                assert torch.equal(out, outs[True]), mode
        finally:
            set_work_stealing(1)
    if amx and decode_kernel_fn(torch.bfloat16, fast=True) is not decode_kernel_fn(torch.bfloat16):
        # AMX's p.V takes p rounded to bf16 (as HF's bf16 attention does), so its outputs
        # are not within an ulp of the portable kernel's; their error against fp32 math stays
        # near the portable kernel's (which rounds only the output)
        ref = torch.stack(refs)
        err = {fast: (out.float() - ref).abs() for fast, out in outs.items()}
        assert err[True].mean() <= 2 * err[False].mean()
        assert err[True].max() <= 2 * err[False].max() + 2.0**-8
    else:  # the two kernels differ by fp32 summation order only: bf16 outputs within one ulp
        assert (diff <= outs[False].float().abs() * 2.0**-7 + 1e-6).all()


def _fast_call(q, kc, vc, table, lens, bs, scale, window=0, softcap=0.0):
    """The fast kernel on decode rows q [B, Hq, D] with their block tables and lengths."""
    b, hq, d = q.shape
    hkv = kc.shape[0]
    out = torch.full_like(q, float("nan"))
    bt = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32))
    ln = torch.from_numpy(np.ascontiguousarray(lens, dtype=np.int32))
    rc = decode_kernel_fn(torch.bfloat16, fast=True)(
        q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3], bt.data_ptr(), bt.stride(0),
        ln.data_ptr(), b, hq, hkv, d, bs, scale, table.shape[1] * bs, window, softcap,
    )  # fmt: skip
    assert rc == 0
    return out


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "rows", "first", "window", "softcap"),
    [
        (9, 3, 64, 9, 400, 0, 0.0),  # 5 + 4 rows an item (16 AMX columns / 3 heads)
        (9, 3, 64, 6, 250, 0, 0.0),  # the rows cross the first 256-key chunk's end
        (32, 8, 64, 5, 30, 0, 0.0),  # 4 heads a kv head: 4 rows an item
        (4, 2, 128, 17, 1, 0, 0.0),  # from a 1-key row, 8 rows an item
        (8, 1, 128, 3, 600, 0, 50.0),  # soft-capped, 2 rows an item
        (9, 3, 64, 5, 300, 128, 0.0),  # windows past their start: each row an item
        (9, 3, 64, 5, 100, 128, 0.0),  # windows not reached: one item
        # AMX's p.V: up to 8 columns its A_odd shares A_even's tile, past 8 a tile of its own
        # (a row alone and its shared item take different tiles); D = 96 and 32: a last pass
        # of one 32-dim half, and a single one
        (6, 2, 96, 7, 290, 0, 0.0),
        (4, 2, 32, 9, 40, 0, 0.0),
    ],
)
def test_a_drafting_requests_rows_have_each_rows_own_bits(
    hq: int, hkv: int, d: int, rows: int, first: int, window: int, softcap: float, amx: bool
) -> None:
    """The rows of a request verifying drafts (the same block table, lengths first, first + 1,
    ...) may share an item, and each gets the bits it gets alone (a plain decode step's):
    greedy output with drafts relies on it. Another request's rows between them, and a
    second request with the same lengths, keep theirs too."""
    if not load_cpu_kernels().vx_has_fast_bf16():
        pytest.skip("the AVX512-BF16 kernel only (the AVX2 kernel takes a row an item)")
    g = torch.Generator().manual_seed(1)
    bs = 16
    width = -(-(first + rows) // bs)
    nb = 3 * width + 2
    kc = torch.randn(hkv, nb, bs, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(hkv, nb, bs, d, generator=g).to(torch.bfloat16)
    kc[:, :: max(nb // 5, 1), 3] *= 4
    perm = torch.randperm(nb, generator=g).numpy()
    a, other = perm[:width], perm[width : 2 * width]
    # request A's rows, one row of another request, then request B (A's lengths, B's blocks)
    table = np.stack([a] * rows + [other] + [other] * rows).astype(np.int32)
    lens = np.array(
        [first + i for i in range(rows)] + [first + 3] + [first + i for i in range(rows)]
    )
    q = torch.randn(len(lens), hq, d, generator=g).to(torch.bfloat16)
    scale = d**-0.5
    together = _fast_call(q, kc, vc, table, lens, bs, scale, window, softcap)
    for i in range(len(lens)):
        alone = _fast_call(q[i : i + 1].clone(), kc, vc, table[i : i + 1], lens[i : i + 1], bs,
                           scale, window, softcap)  # fmt: skip
        assert torch.equal(together[i], alone[0]), i
    blocks = torch.from_numpy(a.astype(np.int64))
    k = kc[:, blocks].reshape(hkv, -1, d).float()
    v = vc[:, blocks].reshape(hkv, -1, d).float()
    for i in range(rows):  # and they are the attention
        n = int(lens[i])
        lo = max(0, n - window) if window else 0
        qq = q[i].float().view(hkv, hq // hkv, d)
        s = qq @ k[:, lo:n].transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        ref = (torch.softmax(s, -1) @ v[:, lo:n]).reshape(hq, d)
        torch.testing.assert_close(together[i].float(), ref, atol=2e-2, rtol=2e-2)
