"""bf16 weights in fp32 GEMMs for CPUs without bf16 arithmetic (AVX2: most laptops, AMD EPYC
before Zen 4).

Runs in: each Worker process.

Why: where the CPU has no bf16 dot products (no AVX512-BF16, no AMX), oneDNN declines bf16
(`_is_mkldnn_bf16_supported()` is False) and torch's bf16 GEMM runs far below the cores' fp32
rate, whatever the rows; the same products in fp32 are well ahead of it from 16 rows up
(measured on a 2-core AMD EPYC, AVX2). A bf16 model stays a bf16 model: bf16 x bf16
products are exact in fp32, the sums are fp32 as in a bf16 GEMM, and the output is rounded to
bf16 once, so only the order of the fp32 sums differs.

Up to a few rows (decode at small batch) a step only streams weights. Those rows go to vx's
AVX2 skinny GEMM on the layer's own bf16 weight (`vx/gpu/cpu/csrc/gemv_avx2.c`: at one row
ahead of torch's bf16 GEMV and of an fp32 copy, which reads twice the bytes; measured on
SmolLM2's layers), or where it is not built, one row to torch's bf16 GEMV. Where the weight
has panels (below), one to four rows take the panel GEMM's sums, bit for bit, from its compact
copy (`vx.gpu.cpu.compact`: the bf16 values in a quarter fewer bytes, in panel order), so a
row's outputs do not depend on its step's row count (speculation's verify rows score as one-row
steps and prompts do).

Where vx's AVX2 panel GEMM is built (`vx/gpu/cpu/csrc/gemm_avx2.c`), N % 16 == 0 and K is
even, a second copy holds the same bf16 values laid out in its panels of 16 columns; the
kernel widens them in registers (a shift or a mask), so its sums are those of an fp32 copy
in half the bytes. It takes every row count from PANEL_FROM_ROWS (5) up, and below it the
rows a compact copy does not (its small-row loop), so that one order of sums serves every row
count. Measured on a 2-core Zen 3, it is ahead of fp32 panels from 10 to 64 rows
and level with them past 256, and those are ahead of oneDNN's packed fp32 GEMM from 25 to
2,048 rows. Otherwise the copy is fp32 in oneDNN's packed layout and oneDNN takes those
rows. `VX_CPU_PANEL_GEMM=0` keeps oneDNN's (A/B runs).

Memory: the panels are the bf16 weight's size again, oneDNN's fp32 copy twice it. The copies
made in one process stop at `VX_CPU_WIDEN_BUDGET` bytes (default: a quarter of physical
memory); the layers past it keep the bf16 path. `VX_CPU_WIDEN=0` turns widening off, `1`
forces it (tests). Without the C library (`VX_CPU_ATTENTION_KERNEL=0`) there is no AVX2
skinny GEMM, and the wide copy takes rows from two, as for the AVX-512 skinny GEMM.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from vx import envs
from vx.gpu.cpu.compact import CompactWeight
from vx.gpu.cpu.emulate import emulating
from vx.gpu.cpu.library import load_cpu_kernels

logger = logging.getLogger(__name__)

__all__ = [
    "PANEL_FROM_ROWS",
    "Int4Avx2",
    "WideWeight",
    "avx2_int8_gemm",
    "avx2_int8_rows",
    "pack_int8_avx2",
    "pack_panels",
    "widen_wanted",
]

#: Rows from which the wide copy is used without the AVX2 skinny GEMM (see above).
WIDE_MIN_ROWS = 2
#: Rows from which the panel GEMM, where a weight has panels and a compact copy, takes the
#: rows (below: the compact copy, the panels' bits; without a compact copy the panels take
#: every row count, their small-row loop up to 4). Measured before, against the skinny GEMM
#: (which no row count of a weight with panels takes now): SmolLM2's 120 layer matrices on a 2-core Zen 3, skinny against the bf16 panels (ms,
#: medians of 9 and of 15, two runs): 3 rows 9.6 / 12.1 and 10.6 / 12.6, 4 rows 12.4 / 11.5
#: and 12.1 / 12.2, 5 rows 12.7 / 11.7 and 16.3 / 13.8, 6 rows 14.0 / 15.6 and 18.7 / 17.8,
#: 7-9 rows 16.4-19.2 / 15.5-18.1 and 17.5-21.9 / 15.9-17.4: level at 4-6 rows, the panels
#: ahead from 7.
PANEL_FROM_ROWS = 5
#: oneDNN lays the packed fp32 weight out for this many rows (decode batches).
_BATCH_HINT = 64

_state: dict[str, object] = {}


def _skinny_rows() -> int:
    """Rows up to which vx's AVX2 skinny GEMM takes the bf16 weight here (0: not built)."""
    if "skinny" not in _state:
        lib = load_cpu_kernels()
        rows = 0 if lib is None else int(lib.vx_gemv_avx2_max_rows())
        _state["skinny"] = rows
        _state["lib"] = lib
    return _state["skinny"]  # type: ignore[return-value]


def avx2_int8_rows() -> int:
    """Rows up to which `avx2_int8_gemm` takes x here (0: the AVX2 kernels are not built)."""
    return _skinny_rows()


def pack_int8_avx2(q: torch.Tensor) -> torch.Tensor | None:
    """int8 [N, K] in the layout `vx_gemv_int8_avx2` reads (in each block of 32 columns, byte
    4 i + j holds column 8 j + i), or None where that kernel is not built or K % 32."""
    n, k = q.shape
    if not avx2_int8_rows() or k % 32:
        return None
    return q.view(n, k // 32, 4, 8).transpose(2, 3).contiguous().view(n, k)


def avx2_int8_gemm(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [M, K] bf16 @ (q * scales [N] bf16).T + bias in bf16, q the int8 [N, K] weight packed by
    `pack_int8_avx2`, through vx's AVX2 kernel (`vx_gemv_int8_avx2`: half the bytes of the
    bf16 weight), or None where it does not take them (not built, too many rows; the caller
    falls back to torch's kernel)."""
    m, (n, k) = x.shape[0], q.shape
    if not (0 < m <= _skinny_rows() and x.dtype == torch.bfloat16 and scales.dtype == x.dtype):
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        y = avx2_int8_gemm(x, q, scales, None)
        return None if y is None else y + bias
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rc = _state["lib"].vx_gemv_int8_avx2(  # type: ignore[union-attr]
        x.data_ptr(), x.stride(0), m, q.data_ptr(), scales.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, n, k,
    )  # fmt: skip
    if rc == -3:
        raise MemoryError("vx AVX2 int8 GEMM could not allocate scratch")
    return y if rc == 0 else None


class Int4Avx2:
    """An int4 weight (groups of 32 columns, w = (q - 8) s + z, `quantize_int4`'s convention)
    in the layout of vx's AVX2 kernel `vx_gemv_int4_avx2`, and its matmul.

    Invariants: `q` [N, K / 2] uint8 holds, in each block of 64 columns, q - 8 of column
    8 j + i as nibble j of 32-bit word i (two's complement); `s` is the scales times 2^-28 and
    `z` the zeros, [N, K / 32] fp32 each; `apply` is x @ W.T + bias for the dequantized W
    (fp32 products and sums, one bf16 rounding), or None where the kernel does not take x.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        n, k = q.shape
        nib = ((q.to(torch.int64) - 8) & 0xF).view(n, k // 64, 8, 8)  # [n, block, j, i]
        words = (nib << (4 * torch.arange(8)).view(1, 1, 8, 1)).sum(dim=2)  # [n, block, i]
        words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits, signed
        self.q = words.to(torch.int32).contiguous().view(torch.uint8).view(n, k // 2)
        self.s = (scales.float() * 2.0**-28).contiguous()
        self.z = zeros.float().contiguous()
        self.n, self.k = n, k

    @staticmethod
    def takes(k: int) -> bool:
        """Whether the kernel is built here and takes K = k."""
        return avx2_int8_rows() > 0 and k % 64 == 0

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        m = x.shape[0]
        if not (0 < m <= _skinny_rows() and x.dtype == torch.bfloat16):
            return None
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            y = self.apply(x, None)
            return None if y is None else y + bias
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = torch.empty(m, self.n, dtype=torch.bfloat16)
        rc = _state["lib"].vx_gemv_int4_avx2(  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), m, self.q.data_ptr(), self.s.data_ptr(),
            self.z.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            self.n, self.n, self.k,
        )  # fmt: skip
        if rc == -3:
            raise MemoryError("vx AVX2 int4 GEMM could not allocate scratch")
        return y if rc == 0 else None


def _native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic (oneDNN's bf16 GEMM); under the emulation, the
    emulated CPU's answer (yes), whatever this one's (`vx.gpu.cpu.emulate.emulating`)."""
    return emulating() or bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def _budget_left() -> int:
    if "left" not in _state:
        budget = envs.VX_CPU_WIDEN_BUDGET
        if budget is not None:
            _state["left"] = budget
        else:
            _state["left"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    return _state["left"]  # type: ignore[return-value]


def widen_wanted(weight: torch.Tensor, *, compact: bool = True) -> bool:
    """Whether this CPU bf16 weight gets a wide copy (panels or fp32; it takes its bytes from the
    budget, with the compact copy `WideWeight(weight, compact=compact)` will make beside it here)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    mode = envs.VX_CPU_WIDEN
    if mode == "0" or (mode != "1" and _native_bf16()):
        return False
    need = weight.numel() * (2 if _panels_take(*weight.shape) else 4)
    if compact and _skinny_rows():
        need += CompactWeight.maybe_size(_state["lib"], weight)
    if need > _budget_left():
        if not _state.get("warned"):
            _state["warned"] = True
            logger.warning(
                "wide weight copies stop at VX_CPU_WIDEN_BUDGET; the other layers run bf16 GEMMs"
            )
        return False
    _state["left"] = _budget_left() - need
    return True


class WideWeight:
    """The copies of one bf16 [N, K] weight that fp32 GEMMs read (the panel GEMM's bf16 panels,
    else an fp32 copy; and the compact copy for one to four rows), and its matmul with bf16 rows.

    Invariant: `apply(x, bias)` equals a bf16 GEMM of x and the bf16 weight (fp32 products
    and sums, one bf16 rounding), up to the order of the sums; `min_rows` is the fewest rows
    the caller should send here. `bf16` is the layer's own weight (no copy). With `all_rows`
    (`--batch-invariant`; panels only) the panel GEMM takes every row count: each output is
    its row's fp32 sum over k in order, so a row's bits do not depend on the rows beside it.
    """

    def __init__(self, weight: torch.Tensor, *, compact: bool = True, all_rows: bool = False) -> None:
        self.bf16 = weight.detach()
        self.all_rows = all_rows
        # vx's panel GEMM where it is built and takes the shape (the bf16 values laid out in
        # its panels, widened in registers), else oneDNN's packed fp32 GEMM on an fp32 copy
        self.panels = pack_panels(self.bf16)
        self.packed = self.panels is None and torch.backends.mkldnn.is_available()
        if self.panels is not None:
            self.weight = self.panels
        else:
            w = self.bf16.float()
            self.weight = (
                torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT) if self.packed else w
            )
        if all_rows and self.panels is None:
            raise ValueError("every row count on the panel GEMM, which does not take this weight")
        self.skinny_rows = _skinny_rows() if self.bf16.is_contiguous() else 0
        self.min_rows = 1 if self.skinny_rows or all_rows else WIDE_MIN_ROWS
        # one to four rows: the panels' outputs from the compact copy's fewer bytes (`compact`
        # False: none, as for the LM head, whose rows the int8 screen serves)
        self.compact = (
            CompactWeight.maybe(_state["lib"], self.bf16) if compact and self.skinny_rows else None
        )

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        if self.all_rows:
            return self._panels(x, bias)
        if self.compact is not None and m <= self.compact.max_rows:
            y = self.compact.apply(x, bias)
            if y is not None:
                return y
        # with panels, every other row count takes them (their small-row loop up to 4 rows):
        # one order of sums for every row count, so a row's bits do not depend on its step's
        skinny = self.skinny_rows if self.panels is None else 0
        if 0 < m <= skinny and x.dtype == torch.bfloat16 and x.stride(-1) == 1:
            return self._skinny(x, bias)
        return self.apply_wide(x, bias)

    def _skinny(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = self.bf16.shape
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return self._skinny(x, None) + bias
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        rc = _state["lib"].vx_gemv_bf16_avx2(  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), x.shape[0], self.bf16.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, n, k,
        )  # fmt: skip
        if rc == -3:
            raise MemoryError("vx AVX2 skinny GEMM could not allocate scratch")
        if rc != 0:  # a shape it does not take (K % 8, K > 16384): the wide copy
            return self.apply_wide(x, bias)
        return y

    def apply_wide(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panels is not None:
            return self._panels(x, bias)
        xf = x.float()
        b = None if bias is None else bias.float()
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(xf, self.weight, b, "none", [], "")
        else:
            y = F.linear(xf, self.weight, b)
        return y.to(x.dtype)

    def _panels(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = self.bf16.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
            x2 = x2.to(torch.bfloat16).contiguous()
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return self._panels(x, None) + bias
        y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        if x2.shape[0]:
            rc = _state["lib"].vx_gemm_panels_avx2(  # type: ignore[union-attr]
                x2.data_ptr(), x2.stride(0), x2.shape[0], self.panels.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), n, n, k,
            )  # fmt: skip
            if rc == -3:
                raise MemoryError("vx AVX2 panel GEMM could not allocate scratch")
            if rc != 0:
                raise RuntimeError(f"vx AVX2 panel GEMM refused its arguments ({rc})")
        return y.view(*lead, n).to(x.dtype)


def _panels_take(n: int, k: int) -> bool:
    """Whether `vx_gemm_panels_avx2` is built here and takes an [n, k] weight (and
    `VX_CPU_PANEL_GEMM=0` does not keep oneDNN's fp32 copy instead, for A/B runs)."""
    if n % 16 or n == 0 or k % 2 or k == 0 or not envs.VX_CPU_PANEL_GEMM:
        return False
    _skinny_rows()  # loads the library
    lib = _state["lib"]
    return lib is not None and bool(lib.vx_has_gemm_panels_avx2())  # type: ignore[attr-defined]


def pack_panels(w: torch.Tensor) -> torch.Tensor | None:
    """W [N, K] (bf16, or values bf16 holds exactly) as `vx_gemm_panels_avx2` reads it: bf16
    [N / 16, K / 2, 16, 2], panel p, pair i, column j holding W[16 p + j, 2 i] and
    W[16 p + j, 2 i + 1] (one 32-bit word, k even in its low half), 32-byte aligned; None
    where `_panels_take` declines the shape (oneDNN's packed fp32 copy instead)."""
    n, k = w.shape
    if not _panels_take(n, k):
        return None
    panels = w.to(torch.bfloat16).view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
    if panels.data_ptr() % 32:  # torch's CPU allocator aligns to 64 bytes; be sure
        buf = torch.empty(panels.numel() + 16, dtype=torch.bfloat16)
        off = (-buf.data_ptr() // 2) % 16
        panels = buf[off : off + panels.numel()].view(n // 16, k // 2, 16, 2).copy_(panels)
    return panels
