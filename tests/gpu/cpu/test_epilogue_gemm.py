"""The AMX VNNI GEMM with more in its epilogue: the gate-up with the SiLU-mul
(`vx_gemm_amx_vnni_silu`, `VnniWeight(silu=True)`) and the qkv projection with the rotary
(`vx_gemm_amx_vnni_rope`, `VnniWeight.apply_rope`). Each must give the bits of the GEMM then
the separate pass (`vx_silu_and_mul_bf16`, `vx_rotary_bf16`) for every row count (partial
32-row blocks, a strided x, past the GEMM's own row range), and the layers must take them for
their rows: the MLP's gate-up from `amx_vnni_rows()[0]` rows with no oneDNN copy kept, the
qkv projection from `[0]` to `[1]`.

Runs in: the test process.
"""

from __future__ import annotations

import pytest
import torch

from vx.gpu.cpu import vnni as cpu_vnni
from vx.gpu.cpu.ops import fused_rotary, fused_silu_and_mul


@pytest.mark.parametrize(("i", "k"), [(1536, 576), (48, 64), (80, 160)])
def test_silu_gemm_is_the_gemm_then_silu_and_mul(amx_vnni, i, k) -> None:
    g = torch.Generator().manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.2).bfloat16()
    plain, silu = cpu_vnni.VnniWeight(w, amx=True), cpu_vnni.VnniWeight(w, amx=True, silu=True)
    for rows in (1, 7, 8, 17, 32, 45, 64, 192, 300, 1100):
        big = torch.randn(rows, k + 64, generator=g).bfloat16()
        x = big[:, 32 : 32 + k]  # row stride k + 64
        got = silu.apply_silu(x)
        assert got is not None and got.shape == (rows, i)
        assert torch.equal(got, fused_silu_and_mul(plain.apply(x, None))), rows


def test_silu_copy_is_for_apply_silu_only(amx_vnni) -> None:
    w = torch.randn(96, 64).bfloat16()
    silu = cpu_vnni.VnniWeight(w, amx=True, silu=True)
    with pytest.raises(RuntimeError):
        silu.apply(torch.randn(8, 64).bfloat16(), None)
    assert not cpu_vnni.vnni_takes(silu, torch.randn(8, 64).bfloat16(), w)
    with pytest.raises(ValueError):  # the gate and up halves are not whole 16-row blocks
        cpu_vnni.VnniWeight(torch.randn(48, 64).bfloat16(), amx=True, silu=True)


@pytest.mark.parametrize("bias", [False, True])
def test_mlp_gate_up_routes_its_rows(amx_vnni, monkeypatch, bias) -> None:
    """Without a bias the gate-up keeps the plain weight (below `amx_vnni_rows()[0]` rows) and
    the SiLU copy (from there, at any row count), no oneDNN copy; with one, the usual copies."""
    from vx.gpu.layers.linear import MergedColumnParallelLinear

    lo = cpu_vnni.amx_vnni_rows()[0]
    g = torch.Generator().manual_seed(9)
    lin = MergedColumnParallelLinear(
        64, [96, 96], bias=bias, dtype=torch.bfloat16, device=torch.device("cpu"),
        silu_pairs=True,
    )  # fmt: skip
    lin.weight.data.copy_(torch.randn(192, 64, generator=g) * 0.2)
    if bias:
        lin.bias.data.copy_(torch.randn(192, generator=g))
    w = lin.weight.data.clone()
    lin.process_weights_after_loading()
    if bias:
        assert lin.vnni is not None and not lin.vnni.silu and lin.packed
        return
    assert lin.vnni is not None and lin.vnni.silu and lin.plain is not None and not lin.packed
    calls = []
    real = lin.vnni.apply_silu
    monkeypatch.setattr(lin.vnni, "apply_silu", lambda x: calls.append(x.shape[0]) or real(x))
    ref = cpu_vnni.VnniWeight(w, amx=True)
    sizes = tuple(r for r in (1, lo - 1, lo, 100, 1500) if r >= 1)
    for rows in sizes:
        x = torch.randn(rows, 64, generator=g).bfloat16()
        got = lin.silu_and_mul(x)
        if rows >= lo:
            assert torch.equal(got, fused_silu_and_mul(ref.apply(x, None))), rows
        else:  # the skinny GEMM on the plain weight, then the SiLU pass
            h = x.float() @ w.float().T
            gate, up = h.bfloat16().chunk(2, dim=-1)
            torch.testing.assert_close(
                got, (torch.nn.functional.silu(gate) * up), atol=0.05, rtol=0.02
            )
    assert calls == [r for r in sizes if r >= lo]


def _rope_tables(g: torch.Generator, m: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(m, 1, d // 2, generator=g) * 6.3
    return angle.cos().bfloat16(), angle.sin().bfloat16()


@pytest.mark.parametrize(
    ("heads", "d", "k"),
    [((9, 3, 3), 64, 576), ((4, 2, 2), 128, 256), ((2, 1, 1), 32, 64), ((3, 1, 1), 96, 96)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_rope_gemm_is_the_gemm_then_rotary(amx_vnni, heads, d, k, bias) -> None:
    hq, hkv, hv = heads
    n, rope_n = (hq + hkv + hv) * d, (hq + hkv) * d
    g = torch.Generator().manual_seed(n + k + d)
    w = (torch.randn(n, k, generator=g) * 0.2).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    vw = cpu_vnni.VnniWeight(w, amx=True)
    for rows in (1, 7, 8, 17, 32, 45, 64, 192, 300, 1100):
        big = torch.randn(rows, k + 64, generator=g).bfloat16()
        x = big[:, 32 : 32 + k]  # row stride k + 64
        cos, sin = _rope_tables(g, rows, d)
        got = vw.apply_rope(x, b, cos, sin, rope_n, d)
        ref = vw.apply(x, b)
        assert fused_rotary(ref[:, :rope_n].view(rows, -1, d), cos, sin)  # in place
        assert got is not None and torch.equal(got, ref), rows


def test_rope_gemm_declines_what_it_cannot_take(amx_vnni) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(640, 64, generator=g).bfloat16()
    vw = cpu_vnni.VnniWeight(w, amx=True)
    x = torch.randn(16, 64, generator=g).bfloat16()
    cos, sin = _rope_tables(g, 16, 160)
    assert vw.apply_rope(x, None, cos, sin, 480, 160) is None  # heads past 128 columns
    cos, sin = _rope_tables(g, 16, 64)
    assert vw.apply_rope(x, None, cos, sin, 100, 64) is None  # not whole heads
    assert vw.apply_rope(x, None, cos[:8], sin[:8], 128, 64) is None  # a row without its angle
    assert vw.apply_rope(x, None, cos.float(), sin.float(), 128, 64) is None


def test_qkv_projection_routes_its_rows(amx_vnni) -> None:
    """`QKVParallelLinear.rope_forward` takes `amx_vnni_rows()` and answers None past them
    (the model then projects and rotates); where taken, the bits of the two steps."""
    from vx.gpu.layers.linear import QKVParallelLinear
    from vx.gpu.layers.rotary import apply_rotary

    lo, hi = cpu_vnni.amx_vnni_rows()
    g = torch.Generator().manual_seed(5)
    lin = QKVParallelLinear(
        96, 32, 4, 2, bias=True, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    lin.weight.data.copy_(torch.randn(256, 96, generator=g) * 0.2)
    lin.bias.data.copy_(torch.randn(256, generator=g))
    lin.process_weights_after_loading()
    assert lin.vnni is not None and lin.vnni.amx
    for rows in (1, lo - 1, lo, 100, hi, hi + 1):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        cos, sin = _rope_tables(g, rows, 32)
        got = lin.rope_forward(x, cos, sin)
        if not lo <= rows <= hi:
            assert got is None, rows
            continue
        ref = cpu_vnni.VnniWeight(lin.plain if lin.plain is not None else lin.weight.data,
                                  amx=True).apply(x, lin.bias)  # fmt: skip
        apply_rotary(ref[:, :192].view(rows, -1, 32), cos, sin)
        assert got is not None and torch.equal(got, ref), rows
