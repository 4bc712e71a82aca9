"""vx's fp32 panel GEMM (`vx.gpu.cpu.fp32_panels`, the GEMM of `--batch-invariant` on fp32
models): the fp32 product for every row count, bias and row stride, and a row's bits the same
whatever rows share its call (each output one FMA chain over k in order). On the x86-64-v3
build too (tests/gpu/cpu/test_kernel_targets.py runs `check_fp32_panels` there).

Runs in: the test process.
"""

from __future__ import annotations

import pytest
import torch

from vx.gpu.cpu.fp32_panels import Fp32Panels, fp32_panels_wanted


def check_fp32_panels() -> None:
    g = torch.Generator().manual_seed(3)
    for n, k in ((16, 1), (48, 64), (960, 576), (80, 77)):
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g)
        panels = Fp32Panels(w)
        x = torch.randn(300, k, generator=g)
        for bias in (None, b):
            full = panels.apply(x, bias)
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            mag = x.double().abs() @ w.double().abs().T + (0 if bias is None else b.double().abs())
            assert bool(((full.double() - ref).abs() <= mag * (k + 1) * 2.0**-24).all()), (n, k)
            for a, e in ((0, 1), (3, 5), (7, 13), (0, 6), (100, 161), (299, 300)):
                assert torch.equal(panels.apply(x[a:e], bias), full[a:e]), (n, k, a, e)
            # a strided x (every other row of a wider tensor): the same rows' bits
            wide = torch.zeros(300, 2 * k)
            wide[:, :k] = x
            assert torch.equal(panels.apply(wide[:, :k], bias), full)


def test_fp32_panel_gemm_is_row_invariant() -> None:
    if not fp32_panels_wanted(torch.zeros(16, 8)):
        pytest.skip("no AVX2 and FMA here: the fp32 panel GEMM is not built")
    check_fp32_panels()


def test_declines_what_it_cannot_take() -> None:
    assert not fp32_panels_wanted(torch.zeros(24, 8))  # N % 16
    assert not fp32_panels_wanted(torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no fp32 panel GEMM"):
        Fp32Panels(torch.zeros(24, 8))
