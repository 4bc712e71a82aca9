"""The row plan of the prepacked linears (`vx.gpu.cpu.row_plan`): which calls oneDNN gets."""

from __future__ import annotations

import pytest
import torch

from vx.gpu.cpu import row_plan as rp
from vx.gpu.cpu.ops import AMX_MAX_ROWS
from vx.gpu.layers import quantization as q
from vx.gpu.layers.linear_method import OneDnnLinear

SIZES = rp.GRID_MAX // rp.GRID_STEP


@pytest.fixture(autouse=True)
def _fresh_plan():
    rp.clear()
    yield
    rp.clear()


def _times(per_row: float = 1e-6, starved: tuple[int, int] | None = None) -> list[float]:
    """A grid of call times: per_row a row, and twice that inside `starved` (rows oneDNN
    leaves to one thread)."""
    out = []
    for i in range(SIZES):
        m = rp.GRID_STEP * (i + 1)
        slow = starved is not None and starved[0] <= m <= starved[1]
        out.append(m * per_row * (2.0 if slow else 1.0))
    return out


def test_plan_keeps_the_whole_call_when_the_rate_is_flat() -> None:
    t = _times()
    assert all(rp.plan_from_times(t, m) == m for m in (1, 40, 200, 576, 1000, 2048, 5000))


def test_plan_cuts_the_starved_rows_into_calls_oneDNN_spreads() -> None:
    t = _times(starved=(224, 1088))
    c = rp.plan_from_times(t, 576)
    assert c <= 192  # the largest grid size below the starved range, or a divisor's worth
    assert rp.plan_from_times(t, 192) == 192  # not starved: one call
    assert rp.plan_from_times(t, 2048) == 2048
    # the estimate it chose: every call at the fast rate, under MIN_GAIN of the whole call
    est = (576 // c) * t[c // rp.GRID_STEP - 1] + (
        t[(576 % c + rp.GRID_STEP - 1) // rp.GRID_STEP - 1] if 576 % c else 0.0
    )
    assert est < rp.MIN_GAIN * t[576 // rp.GRID_STEP - 1]


def test_plan_needs_a_clear_gain() -> None:
    t = _times()
    t[576 // rp.GRID_STEP - 1] *= 1.1  # 10% slower at 576 rows: within MIN_GAIN, kept whole
    assert rp.plan_from_times(t, 576) == 576


def test_chunk_rows_without_a_tuned_shape_or_when_off(monkeypatch) -> None:
    assert rp.chunk_rows(576, 1536, 576) == 576  # never tuned
    rp._times[(576, 1536)] = _times(starved=(224, 1088))
    rp._plans.clear()  # tune() does this when it adds a shape
    assert rp.chunk_rows(576, 1536, 576) < 576
    rp._plans.clear()
    monkeypatch.setattr(rp, "_enabled", False)  # a process started with VX_CPU_ROW_PLAN=0
    assert rp.chunk_rows(576, 1536, 576) == 576
    assert rp.tune([]) == 0


def test_the_switch_is_read_once(monkeypatch) -> None:
    monkeypatch.setenv("VX_CPU_ROW_PLAN", "0")
    assert not rp.enabled()
    monkeypatch.setenv("VX_CPU_ROW_PLAN", "1")
    assert not rp.enabled()  # kept for the process's life
    rp.clear()  # as a new process
    assert rp.enabled()


def _packed_or_skip(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k) * 0.05).bfloat16()
    if not q.cpu_prepack_enabled(w):
        pytest.skip("oneDNN bf16 prepacking is not available on this CPU")
    return w, q.prepack(w)


@pytest.mark.parametrize("bias", [False, True])
def test_a_planned_linear_is_the_row_wise_product(bias: bool) -> None:
    n, k, m = 96, 64, 400
    w, packed = _packed_or_skip(n, k)
    b = (torch.randn(n) * 0.1).bfloat16() if bias else None
    rp._times[(n, k)] = _times(starved=(256, 1024))
    assert rp.chunk_rows(n, k, m) < m  # this call is cut
    x = torch.randn(m, k).bfloat16()
    got = OneDnnLinear(packed).apply(x, b)
    whole = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # each row as oneDNN computes it: within a bf16 ulp of the whole call, and of fp32 math
    torch.testing.assert_close(got.float(), whole.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    # a step of at most AMX_MAX_ROWS rows never asks the plan (vx's own GEMM's rows)
    rp._plans.clear()
    OneDnnLinear(packed).apply(x[:AMX_MAX_ROWS], b)
    assert not rp._plans


def test_tune_times_each_shape_once(monkeypatch) -> None:
    _, packed = _packed_or_skip(32, 64)
    assert rp.tune([(packed, None, 32, 64)]) == 0  # under MIN_WEIGHT_ELEMENTS: not worth it
    monkeypatch.setattr(rp, "MIN_WEIGHT_ELEMENTS", 1)
    assert rp.tune([(packed, None, 32, 64), (packed, None, 32, 64)]) == 1
    t = rp._times[(32, 64)]
    assert len(t) == SIZES and all(0.0 < v < 1.0 for v in t)
    assert rp.tune([(packed, None, 32, 64)]) == 0  # already tuned


def test_vnni_wins_weighs_the_vnni_time_against_the_planned_oneDNN_time() -> None:
    """Untuned: the AMX VNNI GEMM. Tuned: whichever is faster for the shape and rows, oneDNN
    counted under its row plan (its starved sizes cut into fast calls)."""
    assert rp.vnni_wins(576, 576, 600)
    rp.clear()
    sizes = range(rp.VNNI_FROM, 1024 + 1, rp.GRID_STEP)
    rp._times[(576, 576)] = _times(per_row=1e-6)
    rp._vnni_times[(576, 576)] = [m * 0.8e-6 for m in sizes]  # faster everywhere
    rp._times[(3072, 576)] = _times(per_row=1e-6)
    rp._vnni_times[(3072, 576)] = [m * 1.2e-6 for m in sizes]  # slower everywhere
    rp._times[(576, 1536)] = _times(per_row=1e-6, starved=(224, 1088))
    rp._vnni_times[(576, 1536)] = [m * 1.5e-6 for m in sizes]  # slower than the plan's calls
    for m in (224, 300, 576, 1024):
        assert rp.vnni_wins(576, 576, m)
        assert not rp.vnni_wins(3072, 576, m)
        assert not rp.vnni_wins(576, 1536, m)
    assert rp.vnni_wins(3072, 576, 1100)  # past the timed sizes: not measured


def test_tune_vnni_times_the_tuned_shapes_past_the_skinny_rows() -> None:
    calls = []

    class _Vnni:
        def apply(self, x, bias):
            calls.append(x.shape[0])

    rp._times[(1024, 512)] = _times()
    assert rp.tune_vnni([(_Vnni(), 1024, 512, 320), (_Vnni(), 1024, 512, 320)]) == 1
    assert rp.tune_vnni([(_Vnni(), 1024, 512, 320)]) == 0  # timed once
    assert rp.tune_vnni([(_Vnni(), 64, 64, 320)]) == 0  # too small to tune
    assert len(rp._vnni_times[(1024, 512)]) == 4  # 224, 256, 288, 320
    assert set(calls) == {224, 256, 288, 320}
