"""`vx.gpu.layers.fused_moe`: the grouped torch experts against a dense loop over every
(token, slot), for any batch, and the tensor-parallel slices summing to the whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vx.gpu.cpu import vnni as cpu_vnni, widen as cpu_widen
from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.cpu.vnni import amx_vnni_wanted
from vx.gpu.layers import moe_routing
from vx.gpu.layers.cpu_experts import SLACK_ROWS
from vx.gpu.layers.fused_moe import FusedMoE, moe_reference, select_experts
from vx.gpu.layers.linear import silu_and_mul
from vx.gpu.layers.quantization import dequantize_int4, quantize_int4, quantize_int8

E, K, H, INTER = 8, 2, 32, 48


def _dense(x, w13, w2, weights, ids):
    """Every (token, slot) through its expert, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = F.linear(x[t], w13[ids[t, j]]).chunk(2)
            out[t] += F.linear(F.silu(gate) * up, w2[ids[t, j]]) * weights[t, j]
    return out


@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
def test_grouped_equals_dense(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = select_experts(logits, K, renormalize=True, weights_in_fp32=True)
    assert ids.shape == (tokens, K)
    if tokens:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    got = moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, _dense(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_select_experts_without_renormalisation() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 2, renormalize=False, weights_in_fp32=False)
    probs = torch.softmax(logits.float(), -1)
    assert ids.tolist() == [[3, 2]] and weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float(), probs[:, [3, 2]], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("weights_in_fp32", [False, True])
def test_cpu_topk_is_the_torch_ops(renormalize: bool, weights_in_fp32: bool) -> None:
    """The C router top-k (CPU bf16 logits) against the torch ops: the same ids (the logits
    have no ties), weights within the last bits of the fp32 softmax."""
    if load_cpu_kernels() is None:
        pytest.skip("no kernel library here")
    g = torch.Generator().manual_seed(5)
    perms = torch.stack([torch.randperm(8, generator=g) for _ in range(300)])
    scale = 0.1 + torch.rand(300, 1, generator=g) * 3
    wide = torch.zeros(300, 8 + 3)
    wide[:, :8] = perms * scale  # distinct in each row, in bf16 too
    logits = wide.to(torch.bfloat16)[:, :8]
    logits[7] = torch.arange(8)  # ascending: the top ids are the last
    got = select_experts(logits, 3, renormalize=renormalize, weights_in_fp32=weights_in_fp32)
    assert moe_routing._cpu_topk(logits, 3, renormalize, weights_in_fp32) is not None  # C
    probs = torch.softmax(logits.float(), -1)
    w, ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    assert torch.equal(got[1], ids) and got[1][7].tolist() == [7, 6, 5]
    assert got[0].dtype == (torch.float32 if weights_in_fp32 else torch.bfloat16)
    torch.testing.assert_close(got[0].float(), w, atol=0, rtol=2e-6 if weights_in_fp32 else 8e-3)
    tied = select_experts(torch.zeros(1, 8, dtype=torch.bfloat16), 3, renormalize=False,
                          weights_in_fp32=True)  # fmt: skip
    assert tied[1].tolist() == [[0, 1, 2]]  # equal probabilities: the lower ids first


def test_tensor_parallel_slices_sum_to_the_whole() -> None:
    """Each rank's slice of every expert (loaded from the full HF tensors) gives a partial sum;
    the two ranks' partials (what the all-reduce adds) equal the unsharded output."""
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(E, INTER, H, generator=g), torch.randn(E, INTER, H, generator=g)
    down = torch.randn(E, H, INTER, generator=g)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)

    def build(rank: int, size: int) -> FusedMoE:
        moe = FusedMoE(
            E, K, H, INTER, renormalize=True, weights_in_fp32=True,
            dtype=torch.float32, device=torch.device("cpu"), tp_rank=rank, tp_size=size,
        )  # fmt: skip
        for e in range(E):
            moe.weight_loader(gate[e], e, "gate")
            moe.weight_loader(up[e], e, "up")
            moe.weight_loader(down[e], e, "down")
        return moe

    whole = build(0, 1)(x, logits)
    weights, ids = select_experts(logits, K, renormalize=True, weights_in_fp32=True)
    parts = [build(r, 2) for r in range(2)]
    partial = sum(moe_reference(x, m.w13, m.w2, weights, ids) for m in parts)
    torch.testing.assert_close(partial, whole, atol=1e-4, rtol=1e-4)


# ───────────────── the CPU experts: each expert's linears on the dense kernels ─────────────────

#: shapes every CPU GEMM takes (N % 16, K % 32, I % 16 for the AMX SiLU copy, K % 32 for int4)
CH, CI = 64, 32


def _cpu_moe(
    dtype: torch.dtype,
    quantization: str | None = None,
    seed: int = 0,
    hidden: int = CH,
    inter: int = CI,
) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(
        E, K, hidden, inter, renormalize=False, weights_in_fp32=False, dtype=dtype,
        device=torch.device("cpu"), quantization=quantization,
    )  # fmt: skip
    moe.w13.data.copy_(torch.randn(E, 2 * inter, hidden, generator=g) * 0.2)
    moe.w2.data.copy_(torch.randn(E, hidden, inter, generator=g) * 0.2)
    moe.process_weights_after_loading()
    return moe


def _routed(tokens: int, dtype: torch.dtype, seed: int = 1, hidden: int = CH):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, E, generator=g).to(dtype)
    # one expert no token picks: it must cost nothing and add nothing
    logits[:, E - 1] = -30.0
    weights, ids = select_experts(logits, K, renormalize=False, weights_in_fp32=False)
    return x, weights, ids


def _check_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs equal up to the order of fp32 sums and the bf16 roundings they carry:
    a few bf16 steps of the output's scale, and nearly all elements within one step."""
    assert got.dtype is torch.bfloat16 and got.shape == want.shape
    scale = want.float().abs().max().clamp(min=1e-3)
    diff = (got.float() - want.float()).abs()
    assert float(diff.max()) <= 2**-5 * float(scale), float(diff.max())
    assert float((diff <= want.float().abs() * 2**-7 + 2**-9 * scale).float().mean()) > 0.97


@pytest.mark.parametrize("tokens", [0, 1, 2, 7, 40, 300])
def test_cpu_experts_fp32_equal_the_torch_experts(tokens: int) -> None:
    """fp32: the chains are `F.linear` on the experts' own slices, so the same numbers."""
    moe = _cpu_moe(torch.float32)
    assert moe.experts_fn is not moe_reference
    x, weights, ids = _routed(tokens, torch.float32)
    got = moe.experts_fn(x, moe.w13, moe.w2, weights, ids)
    want = moe_reference(x, moe.w13, moe.w2, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _bf16_paths(monkeypatch, path: str) -> None:
    """Route the linears as a CPU of that kind would, where this one has the kernels."""
    lib = load_cpu_kernels()
    if path == "vnni":  # AVX512-BF16 without AMX (Zen 4 and 5)
        if lib is None or not lib.vx_has_gemm_vnni():
            pytest.skip("no AVX512-BF16 here: the VNNI GEMM is not built")
        monkeypatch.setattr(cpu_vnni, "_state", {"lib": lib, "amx": None})
    elif path == "wide":  # no bf16 arithmetic: the fp32 / panel copies
        monkeypatch.setenv("VX_CPU_WIDEN", "1")
        monkeypatch.setattr(cpu_widen, "_state", {})


@pytest.mark.parametrize("path", ["native", "vnni", "wide"])
@pytest.mark.parametrize("tokens", [1, 3, 40, 300])
def test_cpu_experts_bf16_take_the_dense_kernels(tokens: int, path: str, monkeypatch) -> None:
    """bf16: each expert's linears take the chain a dense layer's would here (the AMX GEMM with
    its SiLU epilogue, the VNNI GEMM, the skinny GEMM, the wide copies), and the sum over the
    routed experts is the torch experts' up to the GEMMs' fp32 sums."""
    _bf16_paths(monkeypatch, path)
    moe = _cpu_moe(torch.bfloat16)
    up, down = moe.experts_fn.gate_up[0], moe.experts_fn.down[0]
    if path == "wide":
        assert up.wide is not None and down.wide is not None
    if path == "vnni":
        assert up.vnni is not None and not up.vnni.amx and down.vnni is not None
    if path == "native" and amx_vnni_wanted(moe.w2.data[0]):  # AMX: the SiLU epilogue GEMM
        assert up.vnni is not None and up.vnni.silu and down.vnni is not None
    assert not up.packed and not down.packed  # no oneDNN copies for experts
    x, weights, ids = _routed(tokens, torch.bfloat16)
    got = moe.experts_fn(x, moe.w13, moe.w2, weights, ids)
    _check_bf16(got, moe_reference(x, moe.w13, moe.w2, weights, ids))


def _grouped_run(experts, tokens: int, hidden: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Routed rows grouped by expert with NaN slack past them, and `_run_experts` on them:
    (xs, counts, the experts' outputs)."""
    x, _, ids = _routed(tokens, torch.bfloat16, hidden=hidden)
    order, counts = moe_routing.group_by_expert(ids, E)
    n = tokens * K
    xs = torch.full((n + SLACK_ROWS, hidden), float("nan"), dtype=torch.bfloat16)
    xs[:n] = x[order // K]
    return xs, counts, experts._run_experts(xs, counts)


def _check_each_expert(xs: torch.Tensor, counts: list[int], got: torch.Tensor, own) -> None:
    """Each expert's run of `got` is `own(e, its rows)` bit for bit, and no slack NaN leaked."""
    start = 0
    for e, c in enumerate(counts):
        if c:
            want = own(e, xs[start : start + c])
            assert torch.equal(got[start : start + c], want), (e, c)
        start += c
    assert not got.isnan().any()


@pytest.mark.parametrize(("tokens", "hidden", "inter"), [
    (1, CH, CI), (3, CH, CI), (9, 96, 64), (40, CH, CI), (300, 96, 64), (1100, CH, CI),
])  # fmt: skip
def test_amx_experts_are_each_experts_own_gemms(
    tokens: int, hidden: int, inter: int, amx_vnni
) -> None:
    """The AMX experts' one call (`vx_moe_experts_amx`): for each expert, the bits of its own
    AMX copies' GEMMs (the SiLU gate-up, then the down) on its rows alone, at every row count
    (one row, a partial A tile, several 32-row blocks, panels of them); the slack rows past
    the routed ones are never read into an output (NaN there changes nothing)."""
    moe = _cpu_moe(torch.bfloat16, hidden=hidden, inter=inter)
    experts = moe.experts_fn
    assert experts.grouped is not None
    xs, counts, got = _grouped_run(experts, tokens, hidden)
    n = tokens * K

    def own(e: int, rows: torch.Tensor) -> torch.Tensor:
        return experts.down[e].vnni.apply(experts.gate_up[e].silu_vnni.apply_silu(rows), None)

    _check_each_expert(xs, counts, got, own)
    with pytest.raises(ValueError, match="slack"):
        experts._run_experts(xs[: n + 1], counts)


@pytest.mark.parametrize(("tokens", "hidden", "inter"), [
    (1, CH, CI), (2, 96, 64), (3, CH, CI), (9, 96, 64), (40, CH, CI), (300, 96, 64),
    (1100, CH, CI),
])  # fmt: skip
def test_vnni_experts_are_each_experts_own_gemms(
    tokens: int, hidden: int, inter: int, monkeypatch
) -> None:
    """The VNNI experts' one call (`vx_moe_experts_vnni`, AVX512-BF16 without AMX): for each
    expert, the bits of its own VNNI copies' GEMMs (the gate-up, the SiLU-mul, the down) on its
    rows alone, at every row count (the small-row tile's 1-4 rows an expert, the 8-row tile's
    blocks, panels of 3, 2 and 1 vectors); the slack rows are never read (NaN there changes
    nothing); and the chains, which take the same copies, give the same bits."""
    _bf16_paths(monkeypatch, "vnni")
    moe = _cpu_moe(torch.bfloat16, hidden=hidden, inter=inter)
    experts = moe.experts_fn
    assert experts.grouped is None and experts.grouped_vnni is not None
    xs, counts, got = _grouped_run(experts, tokens, hidden)

    def own(e: int, rows: torch.Tensor) -> torch.Tensor:
        act = silu_and_mul(experts.gate_up[e].vnni.apply(rows, None))
        return experts.down[e].vnni.apply(act, None)

    _check_each_expert(xs, counts, got, own)
    grouped, experts.grouped_vnni = experts.grouped_vnni, None
    try:
        assert torch.equal(experts._run_experts(xs, counts), got)
    finally:
        experts.grouped_vnni = grouped


@pytest.mark.parametrize("weights_in_fp32", [False, True])
@pytest.mark.parametrize("tokens", [1, 6, 300])
def test_cpu_experts_c_glue_is_the_torch_glue(tokens: int, weights_in_fp32: bool) -> None:
    """bf16: the C grouping and weighted sum (`vx/gpu/cpu/csrc/moe.c`) give the torch glue's
    bits, with Mixtral's fp32 weights and Qwen3-MoE's bf16 ones; an out-of-range id is refused."""
    moe = _cpu_moe(torch.bfloat16)
    experts = moe.experts_fn
    if load_cpu_kernels() is None:
        pytest.skip("no kernel library here")
    x, weights, ids = _routed(tokens, torch.bfloat16)
    if weights_in_fp32:
        weights = weights.float() * 1.001  # not bf16 values: the fp32 product is rounded once
    got = experts(x, moe.w13, moe.w2, weights, ids)
    want = experts._torch_glue(x, weights, ids)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="out of range"):
        experts(x, moe.w13, moe.w2, weights, torch.full_like(ids, E))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_cpu_experts_weight_only_quantized(method: str, tokens: int) -> None:
    """int8 / int4: each expert's quantized copy takes its few rows; the output is the torch
    experts' over the dequantized weights, up to bf16 roundings."""
    moe = _cpu_moe(torch.bfloat16, quantization=method)
    assert moe.experts_fn.gate_up[3].quant is not None and moe.experts_fn.down[3].quant is not None

    def deq(w: torch.Tensor) -> torch.Tensor:
        if method == "int8":
            q, s = quantize_int8(w)
            return q.float() * s.float()[:, None]
        return dequantize_int4(*quantize_int4(w))

    w13 = torch.stack([deq(w) for w in moe.w13.data]).bfloat16()
    w2 = torch.stack([deq(w) for w in moe.w2.data]).bfloat16()
    x, weights, ids = _routed(tokens, torch.bfloat16)
    got = moe.experts_fn(x, moe.w13, moe.w2, weights, ids)
    _check_bf16(got, moe_reference(x, w13, w2, weights, ids))
    # and not the unquantized weights' output: the copies were taken
    assert not torch.equal(got, moe_reference(x, moe.w13, moe.w2, weights, ids))
