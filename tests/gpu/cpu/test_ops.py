"""vx's C CPU ops (`vx.gpu.cpu.ops`): the skinny GEMM, fused RMSNorm and SiLU-mul, against
fp32 references and the torch paths they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.gpu.cpu.library import set_work_stealing
from vx.gpu.cpu.ops import (
    GEMV_MAX_ROWS_INT8,
    bf16_max_rows,
    eltwise_kernels,
    fused_add_rms_norm,
    fused_silu_and_mul,
    gemv_fits,
    gemv_kernels,
    skinny_argmax,
    skinny_gemm,
)
from vx.gpu.layers.linear import GemmaRMSNorm, RMSNorm, gelu_tanh_and_mul, silu_and_mul
from vx.gpu.layers.linear_method import PaddedSkinnyLinear, SkinnyLinear, TorchLinear, chain
from vx.gpu.layers.quantization import quantize_int8


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)


needs_gemv = pytest.mark.skipif(gemv_kernels() is None, reason="no AVX-512 C skinny GEMM here")
needs_eltwise = pytest.mark.skipif(eltwise_kernels() is None, reason="no C kernel library here")


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 33, 64, 65, 150, 192])
@pytest.mark.parametrize("n", [4 * 37 + 3, 160])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_skinny_gemm_matches_fp32_reference(rows: int, n: int, kind: str) -> None:
    """Every row count the kernels have a case for (VDPBF16PS / fp32 FMA up to 16 rows, AMX
    tiles four 16-row blocks at a time up to 192 rows), a tail of output rows (N = 4g + 3, or
    whole 16-row tiles), strided x, and bias: one bf16 rounding away from the fp32 result."""
    k = 608
    w = _weight(n, k)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k + 32, generator=g).to(torch.bfloat16)[:, :k]  # row stride k + 32
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    if kind == "int8":
        q, s = quantize_int8(w)
        if not gemv_fits(x, q):
            pytest.skip(f"int8 takes at most {GEMV_MAX_ROWS_INT8} rows")
        got = skinny_gemm(x, q, s, bias)
        want = (x.float() @ q.float().T) * s.float() + bias.float()
    else:
        if not gemv_fits(x, w):
            pytest.skip(f"bf16 {rows} x {n}: not for the C kernels here")
        got = skinny_gemm(x, w, None, bias)
        want = x.float() @ w.float().T + bias.float()
    assert got.dtype is torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)


@needs_gemv
@pytest.mark.parametrize("rows", [3, 20, 70])
def test_skinny_gemm_any_row_stride_is_the_same(rows: int) -> None:
    """x rows at an odd stride (not whole bf16 pairs: the AMX kernel re-lays x out element by
    element instead of by pair gathers) give exactly the contiguous result."""
    k, n = 576, 160
    w = _weight(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    if not gemv_fits(x, w):
        pytest.skip(f"bf16 {rows} x {n}: not for the C kernels here")
    odd = torch.empty(rows, k + 1, dtype=torch.bfloat16)[:, :k]
    odd.copy_(x)
    assert odd.stride(0) % 2 == 1
    assert torch.equal(skinny_gemm(odd, w, None, None), skinny_gemm(x, w, None, None))


@needs_gemv
def test_skinny_gemm_routing() -> None:
    """Small bf16 batches take the skinny GEMM, the same result as F.linear within bf16
    rounding; larger ones, fp32 x and K off the 32 grid keep the dense path."""
    w = _weight(64, 576)
    top = bf16_max_rows()
    x = torch.randn(top + 1, 576).to(torch.bfloat16)
    assert gemv_fits(x[:1], w) and gemv_fits(x[:top], w)
    assert not gemv_fits(x, w)
    assert not gemv_fits(x[:2], w, max_rows=1)
    assert not gemv_fits(x[:1].float(), w)
    assert not gemv_fits(x[:1, :560], w[:, :560])
    for rows in (1, 3, top, top + 1):
        got = chain(SkinnyLinear(w), TorchLinear(w)).apply(x[:rows], None)
        want = torch.nn.functional.linear(x[:rows], w)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)


@pytest.fixture
def stealing():
    """`set_work_stealing` for one test, the default (1) restored after."""
    yield set_work_stealing
    set_work_stealing(1)


@needs_gemv
@pytest.mark.parametrize("mode", [1, 3])
@pytest.mark.parametrize("rows", [3, 16, 17, 64, 65, 150, 192])
def test_skinny_argmax_is_the_argmax_of_skinny_gemm(rows: int, mode: int, stealing) -> None:
    """The greedy ids without the logits: the argmax of exactly the bf16 values
    `skinny_gemm` writes, for every row count the AMX kernel has a case for; a tie (row 0's
    best weight row copied to indices in both threads' halves of N) goes to the first index
    (up to 16 rows); a NaN beats every number, as in numpy's argmax (past 16 rows). None where
    `skinny_gemm` is not on AMX. Mode 3: most blocks of N are taken by stealing, in no fixed
    order (the tie rule must not depend on it)."""
    stealing(mode)
    n, k = 4096, 576
    w = _weight(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    if skinny_argmax(x, w) is None:
        assert not gemv_fits(x, w) or not gemv_kernels().vx_fast_amx(-1)  # type: ignore[union-attr]
        pytest.skip("no AMX skinny GEMM here")
    # row 0's winner copied to an earlier index and around the middle of N
    best0 = int(np.argmax(skinny_gemm(x, w, None, None).float().numpy()[0]))
    w[5], w[n - 7], w[n // 2 - 1], w[n // 2 + 3] = w[best0], w[best0], w[best0], w[best0]
    w[100] = float("nan") if rows > 16 else w[100]  # the NaN case on the larger shapes
    logits = skinny_gemm(x, w, None, None).float().numpy()
    got = skinny_argmax(x, w)
    assert got is not None and got.dtype == np.int64
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got[0] == (100 if rows > 16 else 5)
    # 1-2 rows: AMX too (every row count, so a row's token does not depend on the rows beside it)
    np.testing.assert_array_equal(skinny_argmax(x[:2], w), np.argmax(logits[:2], axis=-1))
    assert skinny_argmax(x.float(), w.float()) is None


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 17, 64, 192])
def test_skinny_gemm_is_the_same_whichever_thread_takes_a_block(rows: int, stealing) -> None:
    """The parallel loops hand items out by stealing (`set_work_stealing`): static ranges
    only (0), the default (1), and most ranges ownerless (3, 7: taken from the back by the
    threads that finish theirs) give bit-identical outputs, every item computed once."""
    if rows > bf16_max_rows():
        pytest.skip(f"the skinny GEMM takes {bf16_max_rows()} rows here")
    n, k = 4 * 37 + 12, 576
    w = _weight(n, k, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    outs = []
    for mode in (0, 1, 3, 7):
        stealing(mode)
        outs.append(skinny_gemm(x, w, None, None))
    want = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(outs[0].float(), want, atol=1e-2, rtol=2**-7)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_gemv
@pytest.mark.parametrize("rows", [1, 3, 32, 192, 193])
def test_a_narrow_linear_takes_the_padded_skinny_gemm(rows: int) -> None:
    """A router-wide bf16 linear (8 outputs, no bias) takes the skinny GEMM on its zero-padded
    copy for the skinny GEMM's rows (oneDNN past them), with the unpadded weight's values: the
    padded rows add nothing and the view has the layer's N columns."""
    from vx.gpu.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(
        256, [8], bias=False, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    w = _weight(8, 256, seed=9)
    layer.weight.data.copy_(w)
    layer.process_weights_after_loading()  # the weight may be oneDNN's copy after this
    padded = layer.method.find(PaddedSkinnyLinear)
    assert padded is not None and padded.padded.shape == (16, 256)
    x = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    got = layer(x)
    want = (x.float() @ w.float().T).to(torch.bfloat16)
    assert got.shape == (rows, 8)
    assert padded.takes(x) == (rows <= bf16_max_rows())
    assert _bf16_ulps(got, want).max() <= 1


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_eltwise
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_matches_torch_path(rows: int, with_residual: bool, monkeypatch) -> None:
    """The C RMSNorm against the module's torch ops: the residual sum is exact (one bf16
    add), the output within one bf16 step (the fp32 sum of squares is ordered differently)
    and almost always identical."""
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5, dtype=torch.bfloat16, device=torch.device("cpu"))
    norm.weight.data.copy_(1 + 0.1 * torch.randn(576, generator=g))
    x = (torch.randn(rows, 576 + 64, generator=g) * 3).to(torch.bfloat16)[:, :576]
    residual = (torch.randn(rows, 576, generator=g) * 3).to(torch.bfloat16)
    fused = fused_add_rms_norm(x, residual if with_residual else None, norm.weight, norm.eps)
    assert fused is not None
    monkeypatch.setattr("vx.gpu.layers.linear.fused_add_rms_norm", lambda *a: None)
    want = norm(x, residual) if with_residual else (norm(x), None)
    out, r = fused
    if with_residual:
        assert torch.equal(r, want[1])
    else:
        assert r is None
    assert _bf16_ulps(out, want[0]).max() <= 1
    assert (out == want[0]).float().mean() >= 0.99


@needs_eltwise
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_head_rms_norm_in_place_equals_the_fused_norm(rows: int) -> None:
    """Qwen3's q / k norms in place in the qkv GEMM's output (heads 128 apart, row stride past
    them): each head's bits are the row norm's (`fused_add_rms_norm`) on that head, and the
    columns after the heads are untouched."""
    g = torch.Generator().manual_seed(6)
    d, nh = 128, 4
    norm = RMSNorm(d, 1e-6, dtype=torch.bfloat16, device=torch.device("cpu"))
    norm.weight.data.copy_(1 + 0.1 * torch.randn(d, generator=g))
    qkv = (torch.randn(rows, (nh + 2) * d, generator=g) * 3).to(torch.bfloat16)
    heads = qkv[:, : nh * d].view(rows, nh, d)
    want = fused_add_rms_norm(heads.reshape(-1, d), None, norm.weight, norm.eps)
    assert want is not None
    rest = qkv[:, nh * d :].clone()
    norm.norm_heads_(heads)
    assert torch.equal(heads.reshape(-1, d), want[0])
    assert torch.equal(qkv[:, nh * d :], rest)


@needs_eltwise
@pytest.mark.parametrize("rows", [1, 9, 200])
def test_fused_silu_and_mul_matches_torch(rows: int, monkeypatch) -> None:
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(rows, 2 * 1536 + 32, generator=g) * 4).to(torch.bfloat16)[:, :3072]
    lib = eltwise_kernels()
    if rows > 8 and not lib.vx_silu_simd():  # scalar C: torch's ops take longer rows
        assert fused_silu_and_mul(gate_up) is None
        got = torch.empty(rows, 1536, dtype=torch.bfloat16)  # the kernel itself, all the same
        lib.vx_silu_and_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), got.data_ptr(), rows, 1536)
    else:
        got = fused_silu_and_mul(gate_up)
    assert got is not None and got.shape == (rows, 1536)
    monkeypatch.setattr("vx.gpu.layers.linear.fused_silu_and_mul", lambda *a: None)
    want = silu_and_mul(gate_up)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)
    assert (got == want).float().mean() >= 0.99


@needs_eltwise
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_torch_path(rows: int, with_residual: bool, monkeypatch) -> None:
    """Gemma's C RMSNorm ((1 + w) in fp32) against GemmaRMSNorm's torch ops, as the Llama one
    above; and on 64-wide rows, the q/k norms' heads (16 lanes at a time, then the scalar
    tail: both forms)."""
    g = torch.Generator().manual_seed(5)
    for h in (576, 64, 40):
        norm = GemmaRMSNorm(h, 1e-6, dtype=torch.bfloat16, device=torch.device("cpu"))
        norm.weight.data.copy_(0.3 * torch.randn(h, generator=g))
        x = (torch.randn(rows, h + 64, generator=g) * 3).to(torch.bfloat16)[:, :h]
        residual = (torch.randn(rows, h, generator=g) * 3).to(torch.bfloat16)
        res = residual if with_residual else None
        fused = fused_add_rms_norm(x, res, norm.weight, norm.eps, gemma=True)
        assert fused is not None
        with monkeypatch.context() as m:
            m.setattr("vx.gpu.layers.linear.fused_add_rms_norm", lambda *a, **k: None)
            want = norm(x, residual) if with_residual else (norm(x), None)
        out, r = fused
        if with_residual:
            assert torch.equal(r, want[1])
        assert _bf16_ulps(out, want[0]).max() <= 1
        assert (out == want[0]).float().mean() >= 0.99
        assert torch.equal(norm(x, res)[0] if with_residual else norm(x), out)  # the module's


@needs_eltwise
@pytest.mark.parametrize("rows", [1, 9, 200])
def test_fused_gelu_tanh_and_mul_matches_torch(rows: int, monkeypatch) -> None:
    """GeGLU in C against torch's gelu(approximate="tanh") * up: within a bf16 step."""
    from vx.gpu.cpu.ops import fused_gelu_tanh_and_mul

    g = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(rows, 2 * 1536 + 32, generator=g) * 4).to(torch.bfloat16)[:, :3072]
    lib = eltwise_kernels()
    got = torch.empty(rows, 1536, dtype=torch.bfloat16)  # the kernel itself, on any CPU
    lib.vx_gelu_tanh_and_mul_bf16(
        gate_up.data_ptr(), gate_up.stride(0), got.data_ptr(), rows, 1536
    )  # fmt: skip
    fused = fused_gelu_tanh_and_mul(gate_up)
    if fused is not None:
        assert torch.equal(fused, got)
    monkeypatch.setattr("vx.gpu.layers.linear.fused_gelu_tanh_and_mul", lambda *a: None)
    want = gelu_tanh_and_mul(gate_up)
    # Far below zero 1 + tanh cancels, in torch too, so there a one-ulp difference in tanh
    # becomes a bf16 step of a tiny value (~3% of these values; each side is as far from the
    # fp64 formula's bf16 as the other, ~11%, all in that region).
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2**-7)
    assert (got == want).float().mean() >= 0.95


@needs_eltwise
def test_partial_rotary_turns_the_leading_dims_only() -> None:
    """`vx_rotary_part_bf16` (Phi-4-mini's partial rotary in the fused step) on heads of 64
    turning 32 dims: torch's expression on those, the rest untouched."""
    g = torch.Generator().manual_seed(7)
    rows, heads, d, r = 5, 3, 64, 32
    x = (torch.randn(rows, heads, d, generator=g) * 3).to(torch.bfloat16)
    pos = torch.arange(rows).float()[:, None] * 7
    freqs = pos * (10000.0 ** (-torch.arange(0, r, 2).float() / r))[None, :]
    cos, sin = (f.to(torch.bfloat16).unsqueeze(1) for f in (freqs.cos(), freqs.sin()))
    x1, x2 = x[..., :r].chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]), dim=-1)
    eltwise_kernels().vx_rotary_part_bf16(
        x.data_ptr(), heads * d, rows, heads, d, r, cos.contiguous().data_ptr(),
        sin.contiguous().data_ptr(),
    )  # fmt: skip
    assert torch.equal(x, want)


@needs_eltwise
def test_fused_ops_leave_other_dtypes_to_torch() -> None:
    x = torch.randn(3, 64)
    assert fused_add_rms_norm(x, None, torch.ones(64), 1e-5) is None
    assert fused_silu_and_mul(x) is None


@needs_eltwise
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("head_dim", [64, 16, 6])
def test_fused_rotary_equals_torch_ops(rows: int, head_dim: int) -> None:
    """In place on the fused QKV output's q and k heads, bit for bit torch's eager expression."""
    from vx.gpu.cpu.ops import fused_rotary

    g = torch.Generator().manual_seed(rows + head_dim)
    heads, kv = 5, 2
    qkv = (torch.randn(rows, (heads + 2 * kv) * head_dim, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (rows,), generator=g).float()[:, None]
    freqs = pos * (10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim))[None, :]
    cos, sin = (f.to(torch.bfloat16).unsqueeze(1) for f in (freqs.cos(), freqs.sin()))
    x = qkv[:, : (heads + kv) * head_dim].view(rows, heads + kv, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    v_before = qkv[:, (heads + kv) * head_dim :].clone()
    assert fused_rotary(x, cos, sin)
    assert torch.equal(x, want)
    assert torch.equal(qkv[:, (heads + kv) * head_dim :], v_before)  # v untouched
    assert not fused_rotary(x.float(), cos, sin)
    assert not fused_rotary(x.transpose(0, 1), cos, sin)
