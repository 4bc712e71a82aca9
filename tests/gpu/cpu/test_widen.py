"""fp32 copies of bf16 weights on CPUs without bf16 arithmetic (`vx.gpu.cpu.widen`).

Runs in: the test process.

A widened GEMM must be the bf16 GEMM (exact products, fp32 sums, one rounding); a widened
model must give the unwidened model's tokens; the copies must stop at the memory budget; and
the automatic choice must follow the CPU (no copies where oneDNN has bf16).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.gpu.conftest import PagedDriver
from vx.gpu.cpu import widen as cpu_widen
from vx.gpu.cpu.widen import WideWeight
from vx.gpu.loader import load_model


@pytest.fixture(autouse=True)
def _fresh_budget(monkeypatch):
    monkeypatch.setattr(cpu_widen, "_state", {})


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "wide")]


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 96, 64), (2, 97, 576), (3, 5, 1536), (4, 192, 128), (2, 64, 36), (17, 192, 128),
     (64, 576, 64)],
)  # fmt: skip
def test_wide_gemm_is_the_bf16_gemm(rows: int, n: int, k: int) -> None:
    """Both paths: the AVX2 skinny GEMM on the bf16 weight (up to 4 rows where it is built;
    K = 36 is a shape it declines) and the fp32 copy."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    ww = WideWeight(w)
    got = ww.apply(x, bias)
    assert got.dtype is torch.bfloat16 and got.shape == (rows, n)
    if rows <= ww.skinny_rows and k % 8 == 0:  # a different kernel from the fp32 copy's
        assert ww.min_rows == 1
        other = ww.apply_wide(x, bias)
        assert (got.float() - other.float()).abs().max() <= other.float().abs().max() * 2**-6
    # fp64 sums of the exact products, rounded once: the widened GEMM differs from it only in
    # the order of its fp32 sums, far below one bf16 step.
    want = (x.double() @ w.double().T + bias.double()).bfloat16()
    diff = (got.float() - want.float()).abs()
    # One bf16 step, plus what fp32 sums of K terms may lose (near-cancelling outputs).
    tol = want.float().abs() * 2**-7 + 1e-5 * (x.float().abs() @ w.float().abs().T)
    assert (diff <= tol).all()
    assert (diff == 0).float().mean() > 0.95


@pytest.mark.parametrize("panels", ["1", "0"])
def test_wide_gemm_takes_the_panel_kernel_where_built(monkeypatch, panels: str) -> None:
    """Where the AVX2 panel GEMM is built, the wide copy is its bf16 panels (no fp32 copy), and
    more rows than the skinny GEMM's go through it, 3-d inputs too; `VX_CPU_PANEL_GEMM=0`
    (or a CPU without it) keeps oneDNN's copy. Both give the bf16 GEMM's values."""
    monkeypatch.setenv("VX_CPU_PANEL_GEMM", panels)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 96, generator=g) * 0.05).bfloat16()
    x = torch.randn(2, 20, 96, generator=g).bfloat16()
    ww = WideWeight(w)
    lib = cpu_widen._state.get("lib")
    built = lib is not None and bool(lib.vx_has_gemm_panels_avx2())
    assert (ww.panels is not None) == (built and panels == "1")
    if ww.panels is not None:
        assert ww.weight is ww.panels and ww.panels.shape == (3, 48, 16, 2)
        assert ww.panels.dtype is torch.bfloat16
    got = ww.apply_wide(x, None)
    assert got.shape == (2, 20, 48) and got.dtype is torch.bfloat16
    want = x.double() @ w.double().T
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()
    assert WideWeight(w[:40]).panels is None  # N % 16: oneDNN's copy
    assert WideWeight(w[:, :95].contiguous()).panels is None  # odd K: oneDNN's copy
    # with panels, no row count takes the skinny GEMM (the compact copy or the panels: the
    # panels' bits); without, it takes its rows
    for rows in (1, cpu_widen.PANEL_FROM_ROWS - 1, cpu_widen.PANEL_FROM_ROWS):
        x2 = x[0, :rows]
        got = ww.apply(x2, None)
        skinny = ww.skinny_rows and ww.panels is None
        want = ww._skinny(x2, None) if skinny else ww.apply_wide(x2, None)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), rows


@pytest.mark.parametrize("compact", ["1", "0"])
def test_one_to_four_rows_take_the_compact_copy_where_built(monkeypatch, compact: str) -> None:
    """Where the AVX2 kernels are built, a widened layer also holds its compact copy, and one
    to four rows take it, with the panel GEMM's very bits; `VX_CPU_COMPACT=0`, the LM head's
    copy (`compact=False`) or a CPU without it: none."""
    monkeypatch.setenv("VX_CPU_COMPACT", compact)
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(48, 96, generator=g) * 0.05).bfloat16()
    ww = WideWeight(w)
    built = ww.skinny_rows > 0 and bool(cpu_widen._state["lib"].vx_compact_max_rows())
    assert (ww.compact is not None) == (built and compact == "1")
    assert WideWeight(w, compact=False).compact is None
    bias = torch.randn(48, generator=g).bfloat16()
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        got = ww.apply(x, bias)
        if ww.compact is not None:
            assert torch.equal(got.view(torch.int16), ww._panels(x, bias).view(torch.int16))
            assert (ww.compact.apply(x, bias) is None) == (rows == 5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_widened_model_gives_the_same_tokens(tiny_models, arch: str, monkeypatch) -> None:
    monkeypatch.setenv("VX_CPU_WIDEN", "0")
    plain = load_model(tiny_models[arch], dtype=torch.bfloat16, progress=False)
    assert all(m.wide is None for m in _linears(plain))
    monkeypatch.setenv("VX_CPU_WIDEN", "1")
    wide = load_model(tiny_models[arch], dtype=torch.bfloat16, progress=False)
    layers = _linears(wide)
    assert len(layers) == 2 * 4 + 1 and all(m.wide is not None for m in layers)  # + LM head
    prompts = {"a": list(range(3, 40)), "b": [7, 1, 9]}
    a, b = PagedDriver(plain), PagedDriver(wide)
    la, lb = a.step_all(prompts), b.step_all(prompts)
    # The two GEMMs' fp32 sums differ in order, so their outputs may differ by a bf16 step,
    # which the layers carry on: this model's logits reach ~6.5, where a step is 2^-5.
    for r in prompts:
        torch.testing.assert_close(la[r], lb[r], rtol=0.02, atol=0.04)
    # Greedy decode: two rows a step (the AVX2 skinny GEMM where it is built).
    toks = {r: int(la[r][-1].argmax()) for r in prompts}
    assert toks == {r: int(lb[r][-1].argmax()) for r in prompts}
    for _ in range(12):
        la = a.step({r: [t] for r, t in toks.items()})
        lb = b.step({r: [t] for r, t in toks.items()})
        toks = {r: int(la[r].argmax()) for r in prompts}
        assert toks == {r: int(lb[r].argmax()) for r in prompts}


def test_copies_stop_at_the_budget(tiny_models, monkeypatch, caplog) -> None:
    monkeypatch.setenv("VX_CPU_WIDEN", "1")
    ref = load_model(tiny_models["llama"], dtype=torch.bfloat16, progress=False)
    first = _linears(ref)[0].weight
    monkeypatch.setattr(cpu_widen, "_state", {})
    # the wide copy is the bf16 panels where the panel GEMM takes the shape, else fp32; the
    # compact copy beside it counts too, where this CPU makes one
    lib = cpu_widen._state["lib"] if cpu_widen._skinny_rows() else None
    wide = first.numel() * (2 if cpu_widen._panels_take(*first.shape) else 4)
    compact = cpu_widen.CompactWeight.maybe_size(lib, first)
    if compact:  # room for the wide copy alone: none
        monkeypatch.setattr(cpu_widen, "_state", {})
        monkeypatch.setenv("VX_CPU_WIDEN_BUDGET", str(wide + 16))
        model = load_model(tiny_models["llama"], dtype=torch.bfloat16, progress=False)
        assert _linears(model)[0].wide is None
        caplog.clear()
    monkeypatch.setattr(cpu_widen, "_state", {})
    # Room for the first layer's copies and a little more, not for the second's.
    monkeypatch.setenv("VX_CPU_WIDEN_BUDGET", str(wide + compact + 16))
    with caplog.at_level(logging.WARNING, logger="vx.gpu.cpu.widen"):
        model = load_model(tiny_models["llama"], dtype=torch.bfloat16, progress=False)
    widened = [m.wide is not None for m in _linears(model)]
    assert widened[0] and sum(widened) < len(widened)
    assert (_linears(model)[0].wide.compact is not None) == bool(compact)
    assert sum("VX_CPU_WIDEN_BUDGET" in r.getMessage() for r in caplog.records) == 1
    out = PagedDriver(model).greedy({"a": [1, 5, 9, 13], "b": list(range(3, 30))}, 4)
    assert all(len(v) == 4 for v in out.values())


def test_automatic_choice_follows_the_cpu(tiny_models, monkeypatch) -> None:
    monkeypatch.delenv("VX_CPU_WIDEN", raising=False)
    model = load_model(tiny_models["llama"], dtype=torch.bfloat16, progress=False)
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert all((m.wide is None) == bool(native) for m in _linears(model))
    fp32 = load_model(tiny_models["llama"], dtype=torch.float32, progress=False)
    assert all(m.wide is None for m in _linears(fp32))  # only bf16 weights are widened


def test_quantized_layers_get_no_compact_copy(tiny_models, monkeypatch) -> None:
    """`--quantization` layers' own kernels take the rows a compact copy would: none is made."""
    monkeypatch.setenv("VX_CPU_WIDEN", "1")
    model = load_model(tiny_models["llama"], dtype=torch.bfloat16, progress=False,
                       quantization="int8")  # fmt: skip
    lins = [m for m in _linears(model) if m.wide is not None]
    assert lins and all(m.wide.compact is None for m in lins)
