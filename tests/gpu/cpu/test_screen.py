"""The LM head's int8 screen (`vx.gpu.cpu.screen`) in this machine's build: the greedy tokens of
the logits path, from half the head's bytes.

Runs in: the test process. The AVX2 build's pair is checked from `test_kernel_targets` with the
same `check_screen`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.gpu.cpu import screen as cpu_screen


def check_screen(lib, screen_name: str, exact_name: str, max_rows: int, **head_kw) -> None:
    """`ScreenedHead.argmax` equals the argmax of the exact kernel's bf16 logits (ties to the
    first index included); the exact rows it recomputes are bit-identical to the full product's;
    every screened logit lies within the bound, which is not a loose one; it declines what it
    cannot decide cheaply. The caller has made `_kernels()` give this pair, and MAX_ROWS
    `max_rows`; `head_kw` go to `ScreenedHead` (its exact kernel then `exact_name`)."""
    g = torch.Generator().manual_seed(0)
    n, k = 3000, 192
    w = torch.randn(n, k, generator=g) * 0.05
    w[1500] = w[700]  # exact ties: the first index must win
    w[2999] = w[700]
    w[11] = w[10] * (1 + 2**-8)  # near-ties: a bf16 step apart at most
    w = w.bfloat16()
    screen = cpu_screen.ScreenedHead(w, **head_kw)
    kernels = screen._kernels
    assert (kernels.screen, kernels.exact) == (screen_name, exact_name)

    def logits(x, rows):
        y = torch.empty(x.shape[0], rows.shape[0], dtype=torch.bfloat16)
        assert kernels.gemv(x, rows.contiguous(), y) == 0
        return y

    taken = 0
    for trial in range(60):
        m = 1 + trial % max_rows
        x = torch.randn(m, k, generator=g) * (0.1 if trial % 3 else 30.0)
        if trial % 5 == 0:
            x[0] = w[700].float() * 40  # row 700 (and its twins) on top
        if trial % 5 == 1:
            x[0] = w[10].float() * 40
        x = x.bfloat16()
        full = logits(x, w)
        want = np.argmax(full.float().numpy(), axis=1)
        got = screen.argmax(x)
        if got is None:
            continue
        taken += 1
        assert np.array_equal(got, want), (trial, got, want)
        if trial % 5 == 0:
            assert got[0] == 700
        idx = torch.tensor([3, 700, 701, 1500, 2999])
        assert torch.equal(logits(x, w[idx]), full[:, idx])  # the subset is the same numbers
        # The bound the search rests on: every screened logit within E of the exact one.
        a = np.empty((m, n), dtype=np.float32)
        rc = getattr(lib, screen_name)(x.data_ptr(), x.stride(0), m, screen.q.data_ptr(),
                                       screen.s.data_ptr(), a.ctypes.data, n, k)  # fmt: skip
        assert rc == 0
        exact = (x.double() @ w.double().T).numpy()
        e = x.double().abs().sum(1).numpy()[:, None] * screen.bound[None, :]
        assert (np.abs(a - exact) <= e).all()
        assert (np.abs(a - exact) > e / 8).any()  # and not a loose one
        # The candidates: every row whose upper end reaches the best lower end less 2^-6 of it.
        l1 = x.double().abs().sum(1).numpy()[:, None]
        lo, hi = a - l1 * screen.bound[None, :], a + l1 * screen.bound[None, :]
        top = lo.max(1, keepdims=True)
        want_cand = hi >= top - np.abs(top) * 2**-6 - 1e-30
        cap = n // 16
        union, cand = np.empty(cap, dtype=np.int64), np.zeros((m, cap), dtype=np.uint8)
        u = lib.vx_screen_select(a.ctypes.data, m, n, screen.bound.ctypes.data, x.data_ptr(),
                                 x.stride(0), k, union.ctypes.data, cand.ctypes.data, cap)  # fmt: skip
        if u >= 0:
            assert np.array_equal(union[:u], np.flatnonzero(want_cand.any(0)))
            assert np.array_equal(cand[:, :u].astype(bool), want_cand[:, union[:u]])
        else:
            assert want_cand.any(0).sum() > cap
    assert taken >= 50
    assert screen.argmax(torch.full((1, k), float("inf")).bfloat16()) is None
    assert screen.argmax(torch.full((1, k), float("nan")).bfloat16()) is None
    flat = cpu_screen.ScreenedHead(torch.ones(n, k).bfloat16())  # every row a candidate
    assert flat.argmax(torch.randn(1, k, generator=g).bfloat16()) is None
    too_many = torch.randn(max_rows + 1, k, generator=g).bfloat16()
    assert screen.argmax(too_many) is None  # > MAX_ROWS


@pytest.mark.timeout(120)
def test_screen_gives_the_skinny_gemms_greedy_tokens(monkeypatch) -> None:
    """The AVX512-BF16 pair (`vx_screen_i8` beside `vx_gemv_bf16`, or where AMX is on beside
    `vx_gemm_amx_bf16`, the logits path's GEMM there at every row count), where this machine
    has it."""
    from vx.gpu.cpu.ops import gemv_kernels

    lib = gemv_kernels()
    kernels = cpu_screen._kernels()
    if lib is None or kernels is None or kernels.screen != "vx_screen_i8":
        pytest.skip("no AVX512-BF16 skinny GEMM here")
    monkeypatch.setattr(cpu_screen, "MAX_ROWS", 4)
    exact = "vx_gemm_amx_bf16" if lib.vx_fast_amx(-1) else "vx_gemv_bf16"
    check_screen(lib, "vx_screen_i8", exact, 4)
    monkeypatch.setenv("VX_CPU_SCREEN_HEAD", "0")
    assert not cpu_screen.screen_wanted(torch.zeros(64, 64, dtype=torch.bfloat16))
