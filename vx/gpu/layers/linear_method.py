"""How one linear's weight is multiplied: a chain of methods, chosen once at load.

Runs in: each Worker process.

A layer's weight may be kept in several forms, each with its own kernel and the rows it suits:
a weight-only quantized copy (`QuantizedWeight`, few rows), fp32 copies on CPUs without bf16
arithmetic (`WideWeight`), a VNNI-packed copy (`VnniWeight`: vx's AVX512-BF16 or AMX GEMM),
the plain bf16 weight for vx's skinny GEMM (decode batches), oneDNN's blocked layout, or the
weight as it is for `F.linear` (CUDA, fp32, anything else). `select_linear_method` decides
once, after loading, from the device, the dtype and the CPU's ISA, which forms a layer keeps
and in which order they are asked; the result is a chain (`LinearMethod`) whose links only
compare the rows of x against their ranges. The chain's last link takes every x.

The same links make the LM head's chain (`vx.gpu.layers.vocab`), in its own order. With
`--batch-invariant` (`set_batch_invariant`, before loading) the chain is one GEMM, vx's AMX or
VNNI GEMM, for every row count (`invariant_method`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from vx.gpu.cpu.fp32_panels import Fp32Panels, fp32_panels_wanted
from vx.gpu.cpu.ops import AMX_MAX_ROWS, gemv_fits, gemv_kernels, skinny_gemm
from vx.gpu.cpu.row_plan import chunk_rows
from vx.gpu.cpu.vnni import (
    VnniWeight,
    amx_vnni_wanted,
    silu_packable,
    vnni_takes,
    vnni_wanted,
)
from vx.gpu.cpu.widen import WideWeight, widen_wanted
from vx.gpu.layers.quantization import QuantizedWeight, cpu_prepack_enabled, prepack

__all__ = [
    "BatchInvariantError",
    "Fp32PanelLinear",
    "LinearMethod",
    "OneDnnLinear",
    "PaddedSkinnyLinear",
    "QuantizedLinear",
    "SkinnyLinear",
    "TorchLinear",
    "VnniLinear",
    "WeightForms",
    "WideLinear",
    "batch_invariant",
    "chain",
    "invariant_method",
    "select_linear_method",
    "set_batch_invariant",
]

M = TypeVar("M", bound="LinearMethod")

#: Batch-invariant inference (`EngineConfig.batch_invariant`), set once by the Worker before
#: the weights are processed: every row count takes one GEMM, so a row's bits do not depend on
#: how many rows share its call.
_batch_invariant = False


class BatchInvariantError(ValueError):
    """`--batch-invariant` on a machine, dtype or mode without a row-invariant GEMM."""


def set_batch_invariant(on: bool) -> None:
    global _batch_invariant
    _batch_invariant = on


def batch_invariant() -> bool:
    return _batch_invariant


def _not_invariant(what: str) -> BatchInvariantError:
    return BatchInvariantError(
        f"--batch-invariant is implemented for bf16 and fp32 on CPUs with AMX, AVX512-BF16 or "
        f"AVX2 (one GEMM, vx's own, for every row count); not for {what}"
    )


class LinearMethod:
    """One way to compute y = x @ W.T + b, for the x it `takes`; other x go to `next`.

    Invariant: following `next` from any link reaches a link whose `takes` is always True.
    """

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next: LinearMethod | None = None

    def takes(self, x: torch.Tensor) -> bool:
        return True

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m: LinearMethod = self
        while not m.takes(x):
            assert m.next is not None
            m = m.next
        return m.run(x, bias)

    def __iter__(self) -> Iterator[LinearMethod]:
        m: LinearMethod | None = self
        while m is not None:
            yield m
            m = m.next

    def find(self, kind: type[M]) -> M | None:
        """The first link of this kind in the chain, or None."""
        return next((m for m in self if isinstance(m, kind)), None)

    def __repr__(self) -> str:
        return " -> ".join(type(m).__name__ for m in self)


class QuantizedLinear(LinearMethod):
    """The weight-only int8 / int4 copy, for x of at most `quant.max_rows` rows."""

    __slots__ = ("quant",)

    def __init__(self, quant: QuantizedWeight) -> None:
        super().__init__()
        self.quant = quant

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.quant.max_rows

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant.apply(x, bias)


class WideLinear(LinearMethod):
    """The fp32 (or compact) copies of a CPU without bf16 arithmetic, from `wide.min_rows`."""

    __slots__ = ("wide",)

    def __init__(self, wide: WideWeight) -> None:
        super().__init__()
        self.wide = wide

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] >= self.wide.min_rows

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.wide.apply(x, bias)


class VnniLinear(LinearMethod):
    """vx's VNNI GEMM (AVX512-BF16) or AMX GEMM over a VNNI-packed copy, for the rows
    `vnni_takes` gives it; a gate-up's SiLU copy takes none here (its caller asks it)."""

    __slots__ = ("plain", "vnni")

    def __init__(self, vnni: VnniWeight, plain: torch.Tensor | None) -> None:
        super().__init__()
        self.vnni, self.plain = vnni, plain

    def takes(self, x: torch.Tensor) -> bool:
        return vnni_takes(self.vnni, x, self.plain)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.vnni.apply(x, bias)


class SkinnyLinear(LinearMethod):
    """vx's skinny GEMM on the plain bf16 weight, for the few rows `gemv_fits` gives it."""

    __slots__ = ("plain",)

    def __init__(self, plain: torch.Tensor) -> None:
        super().__init__()
        self.plain = plain

    def takes(self, x: torch.Tensor) -> bool:
        return gemv_fits(x, self.plain)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return skinny_gemm(x, self.plain, None, bias)


class PaddedSkinnyLinear(LinearMethod):
    """The skinny GEMM on a copy of a narrow bias-free weight padded with zero rows to a
    multiple of 16 (a MoE router's E outputs: the AMX skinny GEMM takes N % 16 == 0 past 2
    rows), its output the first `n` columns of the padded product (a view, row stride the
    padded N). Instead of oneDNN for such a layer's 3-192 rows: its threads are not the C
    kernels' and each handover between them cost more than the product (measured, a 1 B MoE's
    router at 32 rows)."""

    __slots__ = ("n", "padded")

    def __init__(self, plain: torch.Tensor) -> None:
        super().__init__()
        n, k = plain.shape
        self.padded = plain.new_zeros(-(-n // 16) * 16, k)
        self.padded[:n] = plain
        self.n = n

    def takes(self, x: torch.Tensor) -> bool:
        return gemv_fits(x, self.padded)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return skinny_gemm(x, self.padded, None, None)[:, : self.n]


#: Widest weight (outputs) that gets a `PaddedSkinnyLinear` where N % 16 != 0.
PADDED_SKINNY_MAX_N = 64


class OneDnnLinear(LinearMethod):
    """oneDNN's GEMM on the weight in its blocked layout (`packed`, an opaque mkldnn tensor);
    takes every x, in calls of the rows `vx.gpu.cpu.row_plan` spreads over every thread."""

    __slots__ = ("packed",)

    def __init__(self, packed: torch.Tensor) -> None:
        super().__init__()
        self.packed = packed

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.packed
        m, (n, k) = x.shape[0], w.shape
        c = chunk_rows(n, k, m) if m > AMX_MAX_ROWS and x.dim() == 2 else m
        if c >= m:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        y = torch.empty(m, n, dtype=x.dtype)
        for a in range(0, m, c):
            y[a : a + c] = torch.ops.mkldnn._linear_pointwise(x[a : a + c], w, bias, "none", [], "")
        return y


class Fp32PanelLinear(LinearMethod):
    """vx's fp32 panel GEMM (`--batch-invariant` on an fp32 model): every x, each row's sums
    over k in one order whatever the rows."""

    __slots__ = ("panels",)

    def __init__(self, panels: Fp32Panels) -> None:
        super().__init__()
        self.panels = panels

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.panels.apply(x, bias)


class TorchLinear(LinearMethod):
    """`F.linear` on the weight as loaded (CUDA, fp32, and wherever nothing else applies);
    takes every x."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


def chain(*links: LinearMethod | None) -> LinearMethod:
    """The links given (None skipped), each one's `next` the one after it."""
    present = [m for m in links if m is not None]
    for a, b in zip(present, present[1:], strict=False):
        a.next = b
    return present[0]


def select_linear_method(
    layer: Any, *, onednn: bool = True
) -> tuple[LinearMethod, torch.Tensor | None]:
    """A linear's chain after loading, and its weight in oneDNN's layout when the chain ends
    there (the caller then keeps that in place of the plain weight), else None. With `onednn`
    False no oneDNN copy is made and the chain ends in `F.linear` (an expert's linears, which
    keep their stacked weight: `vx.gpu.layers.cpu_experts`).

    `layer` has `weight`, `bias`, `quantization` and, for a [gate; up] read through
    `silu_and_mul`, `silu_pairs`. The forms kept, by machine:
    - weight-only quantization: the quantized copy first (few rows), then the dense chain;
    - no bf16 arithmetic (AVX2): the fp32 copies (`widen_wanted`), then the weight as it is;
    - AVX512-BF16 without AMX: the VNNI copy for every row count (a row's bits whatever the
      rows beside it), the skinny GEMM on the plain weight only where the copy declines x; no
      oneDNN copy;
    - AMX: vx's AMX GEMM over a VNNI copy from one row (the skinny GEMM, also AMX tiles on
      AMX, only where it refuses) and oneDNN for the most; a gate-up's copy is the GEMM with the SiLU-mul in its
      epilogue (`VnniWeight(silu=True)`, asked by `silu_and_mul`) and no oneDNN copy;
    - with the skinny GEMM, a narrow bias-free bf16 weight whose N is not a multiple of 16 (at
      most `PADDED_SKINNY_MAX_N`: a MoE router) also a zero-padded copy for it
      (`PaddedSkinnyLinear`);
    - elsewhere (CUDA, fp32): `F.linear`.
    """
    w = layer.weight
    if _batch_invariant:
        return invariant_method(layer), None
    quant = QuantizedWeight(w.data, layer.quantization) if layer.quantization else None
    # a quantized layer's own kernels take the rows a compact copy would (vx.gpu.cpu.compact)
    compact = quant is None
    wide = WideWeight(w.data, compact=compact) if widen_wanted(w, compact=compact) else None
    head = (
        QuantizedLinear(quant) if quant is not None else None,
        WideLinear(wide) if wide is not None else None,
    )
    skinny = gemv_kernels() is not None
    if quant is None and vnni_wanted(w):
        plain = w.data if skinny else None
        vnni = VnniLinear(VnniWeight(w.data), plain)
        return chain(*head, vnni, SkinnyLinear(plain) if plain is not None else None,
                     TorchLinear(w)), None  # fmt: skip
    if (
        quant is None
        and getattr(layer, "silu_pairs", False)
        and layer.bias is None
        and silu_packable(w)
    ):
        # On AMX the epilogue GEMM from 8 rows and the skinny GEMM below were measured ahead
        # of oneDNN's GEMM then the SiLU through 2,048 rows: no oneDNN copy.
        plain = w.data if skinny else None
        vnni = VnniLinear(VnniWeight(w.data, amx=True, silu=True), plain)
        return chain(*head, vnni, SkinnyLinear(plain) if plain is not None else None,
                     TorchLinear(w)), None  # fmt: skip
    vnni = None
    if quant is None and amx_vnni_wanted(w):
        vnni = VnniWeight(w.data, amx=True)
    # The plain weight stays for the skinny GEMM where oneDNN's copy is made too. NOTE: not
    # tied to oneDNN's bf16: under the emulation (`VX_CPU_EMULATE=1`) an AVX2 host has the
    # AVX-512 kernels without it.
    plain = w.data if w.device.type == "cpu" and w.dtype == torch.bfloat16 and skinny else None
    packed = prepack(w) if onednn and cpu_prepack_enabled(w) else None
    padded = (
        plain is not None
        and quant is None
        and layer.bias is None
        and plain.shape[0] % 16
        and plain.shape[0] <= PADDED_SKINNY_MAX_N
    )
    return chain(
        *head,
        VnniLinear(vnni, plain) if vnni is not None else None,
        PaddedSkinnyLinear(plain) if padded else None,
        SkinnyLinear(plain) if plain is not None else None,
        OneDnnLinear(packed) if packed is not None else TorchLinear(w),
    ), packed


class WeightForms:
    """What a linear's method chain (`self.method`, chosen once by `select_linear_method`)
    keeps besides the weight, read-only: the fused C step and the tests look at them."""

    method: LinearMethod

    def _process(self) -> None:
        """After loading: choose the chain; oneDNN's copy, when made, replaces the weight."""
        method, packed = select_linear_method(self)
        self.method = method
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)

    @property
    def quant(self) -> QuantizedWeight | None:
        m = self.method.find(QuantizedLinear)
        return None if m is None else m.quant

    @property
    def wide(self) -> WideWeight | None:
        m = self.method.find(WideLinear)
        return None if m is None else m.wide

    @property
    def vnni(self) -> VnniWeight | None:
        m = self.method.find(VnniLinear)
        return None if m is None else m.vnni

    @property
    def plain(self) -> torch.Tensor | None:
        """The unpacked bf16 weight of the skinny GEMM."""
        m = self.method.find(SkinnyLinear)
        return None if m is None else m.plain

    @property
    def packed(self) -> bool:
        """Whether `weight` is in oneDNN's blocked layout."""
        return self.method.find(OneDnnLinear) is not None


def invariant_method(layer: Any) -> LinearMethod:
    """The batch-invariant chain: one GEMM for every row count, with no skinny GEMM or oneDNN
    beside it: vx's AMX GEMM where AMX is on, else its VNNI GEMM (AVX512-BF16), else (AVX2)
    its panel GEMM; for fp32 weights its fp32 panel GEMM (`vx.gpu.cpu.fp32_panels`). Each sums a row's products over k in one order whatever the rows
    (`vx/gpu/cpu/csrc/gemm_vnni.c`, `gemm_amx_vnni.c`: the AMX tiles' rows are independent,
    and x's last row block is zero-padded; `gemm_avx2.c`), and its copy takes every row
    (`VnniWeight(all_rows=True)`, `WideWeight(all_rows=True)`)."""
    w = layer.weight
    if layer.quantization:
        raise _not_invariant(f"--quantization {layer.quantization}")
    if fp32_panels_wanted(w):
        return Fp32PanelLinear(Fp32Panels(w.data))
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        raise _not_invariant(f"{w.dtype} on {w.device.type}")
    if amx_vnni_wanted(w):
        return chain(VnniLinear(VnniWeight(w.data, amx=True, all_rows=True), None), TorchLinear(w))
    if vnni_wanted(w):
        return chain(VnniLinear(VnniWeight(w.data, all_rows=True), None), TorchLinear(w))
    if widen_wanted(w, compact=False):
        try:
            wide = WideWeight(w.data, compact=False, all_rows=True)
        except ValueError:  # no panel GEMM here, or not for this shape
            raise _not_invariant(f"a {tuple(w.shape)} weight (no panel GEMM for it)") from None
        return chain(WideLinear(wide), TorchLinear(w))
    raise _not_invariant(f"a {tuple(w.shape)} weight on this CPU (no VNNI, AMX or panel GEMM)")
