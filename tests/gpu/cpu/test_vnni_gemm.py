"""vx's VNNI-layout bf16 GEMMs (`vx.gpu.cpu.vnni`): VDPBF16PS on AVX512-BF16 CPUs without AMX,
AMX tiles on AMX CPUs. They must give the fp32 product rounded once to bf16 (up to the order of
the fp32 sums), for every row count, panel remainder, bias and row stride, and the linears must
take them for their rows; the AMX one bit-identical to the AMX skinny GEMM where both apply.
On an AMX machine the VDPBF16PS kernel is built too and is tested here directly.

Runs in: the test process.
"""

from __future__ import annotations

import pytest
import torch

from vx.gpu.cpu import vnni as cpu_vnni
from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.cpu.ops import bf16_max_rows


@pytest.fixture()
def vnni(monkeypatch):
    lib = load_cpu_kernels()
    if lib is None or not lib.vx_has_gemm_vnni():
        pytest.skip("no AVX512-BF16 here: the VNNI GEMM is not built")
    monkeypatch.setattr(cpu_vnni, "_state", {"lib": lib})
    return lib


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """got (bf16) is x @ w.T + b (fp64) rounded once to bf16, up to the fp32 sums' error:
    half a bf16 step of the value plus K fp32 roundings of the terms' magnitudes."""
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    bound = ref.abs() * 2.0**-8 + mag * x.shape[1] * 2.0**-24
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 16, 32), (7, 32, 64), (8, 48, 64), (9, 80, 96), (13, 960, 576), (64, 576, 1536),
     (130, 112, 160), (300, 3072, 576)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_fp32_product(vnni, m, n, k, bias) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = cpu_vnni.VnniWeight(w).apply(x, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, x, w, b)


def test_strided_and_misaligned_rows(vnni) -> None:
    """A view with a wider row stride is read in place; an odd-offset view is copied first."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=g).bfloat16()
    big = torch.randn(20, 200, generator=g).bfloat16()
    vw = cpu_vnni.VnniWeight(w)
    for x in (big[:, 8:72], big[:, 1:65], big[3:17, 100:164]):
        _check(vw.apply(x, None), x, w, None)


def test_declines_what_it_cannot_pack(vnni) -> None:
    assert not cpu_vnni.vnni_wanted(torch.zeros(24, 64, dtype=torch.bfloat16))  # N % 16
    assert not cpu_vnni.vnni_wanted(torch.zeros(32, 48, dtype=torch.bfloat16))  # K % 32
    assert not cpu_vnni.vnni_wanted(torch.zeros(32, 64))  # fp32
    rc = vnni.vx_pack_vnni_bf16(0, 24, 64, 0)
    assert rc == -2


def test_linears_take_it_at_every_row_count(vnni, monkeypatch) -> None:
    """A linear built here keeps the plain weight and the VNNI copy (every row count from
    `VNNI_MIN_ROWS`, one: a row's bits never depend on the step's rows), and no oneDNN copy;
    both give the product."""
    from vx.gpu.layers.linear import ColumnParallelLinear
    from vx.gpu.layers.vocab import ParallelLMHead

    monkeypatch.setattr(cpu_vnni, "_state", {"lib": vnni})
    g = torch.Generator().manual_seed(5)
    lin = ColumnParallelLinear(
        96, [160], bias=True, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    lin.weight.data.copy_(torch.randn(160, 96, generator=g))
    lin.bias.data.copy_(torch.randn(160, generator=g))
    lin.process_weights_after_loading()
    assert lin.vnni is not None and not lin.packed
    calls = []
    real = lin.vnni.apply
    monkeypatch.setattr(lin.vnni, "apply", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    sizes = (1, cpu_vnni.VNNI_MIN_ROWS, bf16_max_rows(), bf16_max_rows() + 1, 40)
    for rows in sizes:
        x = torch.randn(rows, 96, generator=g).bfloat16()
        _check(lin(x), x, lin.weight, lin.bias)
    # every row count on the VNNI copy (from VNNI_MIN_ROWS, which is one)
    assert cpu_vnni.VNNI_MIN_ROWS == 1
    assert calls == [r for r in sizes if r >= cpu_vnni.VNNI_MIN_ROWS]
    head = ParallelLMHead(64, 96, dtype=torch.bfloat16, device=torch.device("cpu"))
    head.weight.data.copy_(torch.randn(64, 96, generator=g))
    head.process_weights_after_loading()
    assert head.vnni is not None and head.packed_copy is None
    h = torch.randn(30, 96, generator=g).bfloat16()
    _check(head.compute_logits(h), h, head.weight, None)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (80, 96), (16, 32), (3072, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_vnni_rows_do_not_depend_on_the_rows_beside_them(vnni, n, k, bias) -> None:
    """Row invariance without AMX: each row of a 1-17-row call (1-4 rows: the small-row loop;
    past them the general loop's 8-row tiles and their remainders) is bit-identical to the
    same row of a 40-row call, with the small-row loop on or off and whichever thread takes
    an item; so speculation's verify rows score as one-row steps do."""
    from vx.gpu.cpu.library import set_work_stealing

    g = torch.Generator().manual_seed(n + k + bias)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    vw = cpu_vnni.VnniWeight(w)
    x = torch.randn(40, k + 32, generator=g).bfloat16()[:, 16 : 16 + k]  # a row stride past k
    x[3, :5] = 0.0  # a row with zero products (signed zeros), as padding gives
    ref = vw.apply(x, b)
    _check(ref, x, w, b)
    small = vnni.vx_vnni_small_loop(-1)
    assert small >= 1
    try:
        for loop in (small, 0):
            vnni.vx_vnni_small_loop(loop)
            for mode in (1, 0, 3):
                set_work_stealing(mode)
                for rows in range(1, 18):
                    for at in {0, 40 - rows}:
                        got = vw.apply(x[at : at + rows], b)
                        assert torch.equal(got, ref[at : at + rows]), (loop, mode, rows, at)
    finally:
        vnni.vx_vnni_small_loop(small)
        set_work_stealing(1)


def test_screen_candidates_take_the_vnni_gemm(vnni, monkeypatch) -> None:
    """A head with a VNNI copy takes it at one row too, so its int8 screen computes the
    candidates by the VNNI GEMM (`vx_gemm_vnni_bf16` on their rows, packed): the screen's token
    is the argmax of the one-row logits, and of that row in a many-row step."""
    from vx.gpu.cpu import screen as cpu_screen
    from vx.gpu.layers.vocab import ParallelLMHead

    lib = load_cpu_kernels()
    if lib.vx_fast_amx(-1) or lib.vx_has_screen() != 1:
        pytest.skip("AMX on (its own GEMM), or no VDPBF16PS screen here")
    monkeypatch.setattr(cpu_vnni, "_state", {"lib": vnni})
    g = torch.Generator().manual_seed(11)
    head = ParallelLMHead(4000, 576, dtype=torch.bfloat16, device=torch.device("cpu"))
    w = torch.randn(4000, 576, generator=g) * 0.05
    w[7] = w[3]  # a tie: the first index wins on every path
    head.weight.data.copy_(w)
    head.process_weights_after_loading()
    assert head.vnni is not None and head.screen is not None
    assert head.screen.exact_kernel() == "vx_gemm_vnni_bf16"
    x = torch.randn(24, 576, generator=g).bfloat16()
    x[5] = head.weight[3].float().bfloat16() * 4  # its argmax is the tied pair
    many = head.compute_logits(x)
    assert (head.vnni.argmax(x) == many.argmax(-1).numpy()).all()
    for i in range(x.shape[0]):
        row = x[i : i + 1]
        one = head.compute_logits(row)
        assert torch.equal(one, many[i : i + 1]), i
        got = head.greedy_ids(row)
        assert got is not None and got[0] == int(one.argmax(-1)), i
        ys = torch.empty(1, 37, dtype=torch.bfloat16)
        sub = head.weight[100:137]
        assert head.screen._kernels.gemv(row, sub, ys) == 0
        assert torch.equal(ys, many[i : i + 1, 100:137]), i
    assert int(head.greedy_ids(x[5:6])[0]) == 3
    assert cpu_screen.MAX_ROWS == 1  # more rows: the VNNI argmax, the same GEMM


@pytest.mark.parametrize("rows", [9, 64, 200])
def test_same_whichever_thread_takes_a_panel(vnni, rows: int) -> None:
    """Panels are handed out by `vx_ws` (static ranges, stealing, mostly ownerless ranges):
    bit-identical outputs in every mode."""
    from vx.gpu.cpu.library import set_work_stealing

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(16 * 41, 576, generator=g).bfloat16()  # 14 panels, the last one of 2
    x = torch.randn(rows, 576, generator=g).bfloat16()
    vw = cpu_vnni.VnniWeight(w)
    outs = []
    try:
        for mode in (0, 1, 3, 7):
            set_work_stealing(mode)
            outs.append(vw.apply(x, None))
    finally:
        set_work_stealing(1)
    _check(outs[0], x, w, None)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize(("m", "n", "k"), [(2, 16, 32), (9, 80, 96), (64, 4096, 576)])
def test_argmax_is_the_first_maximum_of_the_bf16_product(vnni, m, n, k) -> None:
    """`VnniWeight.argmax` gives the token `apply(...).float().argmax(-1)` gives, ties
    included (duplicated weight rows give equal outputs: the first index wins, whichever
    thread's panel holds it)."""
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    for weight in (w, torch.cat([w[: n // 2], w[: n // 2]])):  # every output twice
        vw = cpu_vnni.VnniWeight(weight)
        want = vw.apply(x, None).float().argmax(-1).numpy()
        assert (vw.argmax(x) == want).all()
        assert (want < n // 2).all() or weight is w


def test_lm_head_greedy_ids_take_the_argmax(vnni, monkeypatch) -> None:
    from vx.gpu.layers.vocab import ParallelLMHead

    monkeypatch.setattr(cpu_vnni, "_state", {"lib": vnni})
    g = torch.Generator().manual_seed(9)
    head = ParallelLMHead(256, 96, dtype=torch.bfloat16, device=torch.device("cpu"))
    head.weight.data.copy_(torch.randn(256, 96, generator=g))
    head.process_weights_after_loading()
    h = torch.randn(20, 96, generator=g).bfloat16()
    ids = head.greedy_ids(h)
    assert ids is not None
    assert (ids == head.compute_logits(h).argmax(-1).numpy()).all()
    # one row: the int8 screen's token where it is built (vx.gpu.cpu.screen), else the logits
    one = head.greedy_ids(h[:1])
    if head.screen is None:
        assert one is None
    else:
        assert one is not None and one[0] == head.compute_logits(h[:1]).argmax(-1).item()


@pytest.mark.parametrize(("n", "k"), [(960, 576), (48, 64), (80, 96), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_vnni_is_bit_identical_to_the_amx_skinny_gemm(amx_vnni, n, k, bias) -> None:
    """The same fp32 sums in the same order as `vx_gemm_amx_bf16` on the plain weight, for
    every row count it takes: whole and partial 32-row blocks, an odd count of 16-column
    blocks (48, 80), a bias, a strided x."""
    from vx.gpu.cpu.ops import skinny_gemm

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    vw = cpu_vnni.VnniWeight(w, amx=True)
    for rows in (*range(1, 18), 32, 45, 64, 72, 192):  # 1-16: the M-row tiles' loop
        big = torch.randn(rows, k + 64, generator=g).bfloat16()
        x = big[:, 32 : 32 + k]  # row stride k + 64
        got = vw.apply(x, b)
        assert torch.equal(got, skinny_gemm(x.contiguous(), w, None, b)), rows


@pytest.mark.parametrize(("n", "k"), [(960, 576), (96, 96), (3072, 576)])
def test_amx_rows_do_not_depend_on_the_rows_beside_them(amx_vnni, n, k) -> None:
    """With AMX every row count takes the AMX GEMM (speculation's scored rows against one-row
    steps): each row of a 1-192-row call, plain or with the SiLU epilogue, is its one-row
    call's bits, and the LM head's greedy token is its one-row token."""
    from vx.gpu.cpu.ops import skinny_gemm

    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    vw, sw = cpu_vnni.VnniWeight(w, amx=True), cpu_vnni.VnniWeight(w, amx=True, silu=True)
    x = torch.randn(192, k, generator=g).bfloat16()
    one = [vw.apply(x[i : i + 1], b) for i in range(192)]
    one_silu = [sw.apply_silu(x[i : i + 1]) for i in range(192)]
    for rows in (2, 3, 5, 7, 8, 16, 17, 40, 192):
        got, silu, plain = vw.apply(x[:rows], b), sw.apply_silu(x[:rows]), skinny_gemm(
            x[:rows], w, None, b)  # fmt: skip
        for i in range(rows):
            assert torch.equal(got[i : i + 1], one[i]), (rows, i)
            assert torch.equal(plain[i : i + 1], one[i]), (rows, i)
            assert torch.equal(silu[i : i + 1], one_silu[i]), (rows, i)


@pytest.mark.parametrize("rows", [193, 300, 1024])
def test_amx_vnni_past_the_skinny_rows_is_the_fp32_product(amx_vnni, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(112, 160, generator=g).bfloat16()
    x = torch.randn(rows, 160, generator=g).bfloat16()
    b = torch.randn(112, generator=g).bfloat16()
    _check(cpu_vnni.VnniWeight(w, amx=True).apply(x, b), x, w, b)


def test_amx_linears_route_the_middle_rows_to_it(amx_vnni, monkeypatch) -> None:
    """With AMX a linear keeps three copies: the plain weight (the skinny GEMM, below
    `amx_vnni_rows()[0]`), the VNNI copy (through `[1]`) and oneDNN's (past it; under the
    emulation there is none, and F.linear on the plain weight takes those rows)."""
    from vx.gpu.layers.linear import ColumnParallelLinear
    from vx.gpu.layers.quantization import cpu_prepack_enabled

    lo, hi = cpu_vnni.amx_vnni_rows()
    assert 1 <= lo <= 192 < hi
    g = torch.Generator().manual_seed(6)
    lin = ColumnParallelLinear(
        96, [160], bias=True, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    lin.weight.data.copy_(torch.randn(160, 96, generator=g))
    lin.bias.data.copy_(torch.randn(160, generator=g))
    plain = lin.weight.data.clone()
    lin.process_weights_after_loading()
    assert lin.vnni is not None and lin.vnni.amx and lin.plain is not None
    assert lin.packed == cpu_prepack_enabled(plain)
    calls = []
    real = lin.vnni.apply
    monkeypatch.setattr(lin.vnni, "apply", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    sizes = tuple(r for r in (1, lo - 1, lo, 100, hi, hi + 1) if r >= 1)
    for rows in sizes:
        x = torch.randn(rows, 96, generator=g).bfloat16()
        _check(lin(x), x, plain, lin.bias)
    assert calls == [r for r in sizes if lo <= r <= hi]
    monkeypatch.setenv("VX_CPU_AMX_VNNI", "0")
    monkeypatch.setattr(cpu_vnni, "_state", {})
    assert not cpu_vnni.amx_vnni_wanted(plain)


def _invariant_linears(monkeypatch, amx: bool) -> None:
    """With `--batch-invariant` (`set_batch_invariant`), a linear's and the LM head's chain is
    one copy for every row count (`all_rows`: the AMX GEMM's with `amx`, else the VNNI GEMM's),
    and a row's bits are the same whatever rows share its call."""
    from vx.gpu.layers import linear_method
    from vx.gpu.layers.linear import ColumnParallelLinear
    from vx.gpu.layers.vocab import ParallelLMHead

    monkeypatch.setattr(linear_method, "_batch_invariant", True)
    g = torch.Generator().manual_seed(12)
    lin = ColumnParallelLinear(
        576, [960], bias=True, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    lin.weight.data.copy_(torch.randn(960, 576, generator=g))
    lin.bias.data.copy_(torch.randn(960, generator=g))
    lin.process_weights_after_loading()
    head = ParallelLMHead(512, 576, dtype=torch.bfloat16, device=torch.device("cpu"))
    head.weight.data.copy_(torch.randn(512, 576, generator=g))
    head.process_weights_after_loading()
    for layer in (lin, head):
        v = layer.vnni
        assert v is not None and v.all_rows and v.amx == amx
        assert layer.plain is None and not layer.packed and head.screen is None
    x = torch.randn(300, 576, generator=g).bfloat16()
    full, logits = lin(x), head.compute_logits(x)
    _check(full, x, lin.weight, lin.bias)
    for a, b in ((0, 1), (0, 2), (0, 3), (5, 12), (0, 16), (7, 40), (100, 101), (0, 257)):
        assert torch.equal(lin(x[a:b]), full[a:b]), (a, b)
        assert torch.equal(head.compute_logits(x[a:b]), logits[a:b]), (a, b)
        ids = head.greedy_ids(x[a:b])  # where a kernel gives them: the logits' argmax
        assert ids is None or (ids == logits[a:b].argmax(-1).numpy()).all()


def test_batch_invariant_linears_take_the_vnni_gemm_for_every_row_count(vnni, monkeypatch):
    monkeypatch.setattr(cpu_vnni, "_state", {"lib": vnni, "amx": None})  # AMX's off
    _invariant_linears(monkeypatch, amx=False)


def test_batch_invariant_linears_take_the_amx_gemm_for_every_row_count(amx_vnni, monkeypatch):
    _invariant_linears(monkeypatch, amx=True)
