"""The compact copy of a bf16 weight: the same values, exactly, in 12.25 bits each, for the
one- to four-row GEMMs of CPUs with AVX2 and no AVX-512.

Runs in: each Worker process (`vx.gpu.cpu.widen.WideWeight` makes one per widened layer; the
fused step's `vx_linear` points at it, `vx.gpu.cpu.fused_step`).

Why: at one row a decode step streams the layers' weights and nothing else bounds it (Zen 3:
the bf16 skinny GEMM reads them at this machine's read rate). bf16 spends 8 bits on the
exponent, but within 32 neighbouring weights of a trained matrix the exponents span a few
values: stored as a 3-bit distance from the block's largest, beside the sign, 99.7% of
SmolLM2's blocks keep every value exactly in 4 bits of high byte instead of 8. The kernel
(`vx/gpu/cpu/csrc/gemv_compact_avx2.c`, where the layout is written out) reads it in the panel
GEMM's order and gives `vx_gemm_panels_avx2`'s outputs bit for bit, so a row's tokens do not
depend on the rows beside it (prompts and batches from five rows take the panels); at one row
SmolLM2's 120 layer matrices save time in proportion to the bytes (measured on a 2-core Zen 3,
in the row-major order it had before; `bench/avx2_rows.py`).

Memory: 0.77x the bf16 weight, beside it (where the weight has no panels, the bf16 weight
serves 1-24 rows, the fp32 copy the rest). `VX_CPU_COMPACT=0` leaves it out (A/B runs).
"""

from __future__ import annotations

import torch

from vx import envs

__all__ = ["CompactWeight", "pack_compact", "panel_order"]

#: Byte j of a block holds column _COLUMN[j] (the kernel's unpacks work within 128-bit lanes).
_COLUMN = torch.tensor([8 * ((j & 15) >> 2) + (j & 3) + 4 * (j >> 4) for j in range(32)])
#: The largest distance a code holds; a block past it is stored raw.
_MAX_D = 7
_RAW = 0xFF
#: Values packed at a time (a slice of rows): bounds the int32 work arrays.
_SLICE_VALUES = 1 << 18


def pack_compact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 [N, K] (K % 32 == 0) in blocks of 32 values, as `vx_gemv_compact_avx2` reads
    `pack_compact(panel_order(W))`: (blocks [N, K / 32, 48] uint8, hb [N, K / 32] uint8,
    raw [R, 32] bf16, at least one row). Every value, NaNs and signed zeros included, decodes
    to its own bits."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or k % 32:
        raise ValueError(f"pack_compact takes bf16 [N, K] with K % 32 == 0, not {w.dtype} {k}")
    w = w.contiguous()
    blocks = torch.empty(n, k // 32, 48, dtype=torch.uint8)
    hb = torch.empty(n, k // 32, dtype=torch.uint8)
    raws: list[torch.Tensor] = []
    # in slices of rows: the int32 work arrays stay small (a whole matrix's left the Worker's
    # malloc holding hundreds of MB after loading)
    step = max(1, _SLICE_VALUES // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        raws.append(_pack_rows(w[r0:r1], blocks[r0:r1], hb[r0:r1], sum(len(x) for x in raws)))
    raw = torch.cat(raws) if any(len(x) for x in raws) else torch.zeros(1, 32, dtype=w.dtype)
    return blocks, hb, raw.contiguous()


def _pack_rows(w: torch.Tensor, blocks: torch.Tensor, hb_out: torch.Tensor, base: int):
    """Rows of `pack_compact` into `blocks` and `hb_out`; their raw blocks, whose indices
    start at `base`."""
    n, k = w.shape
    u = w.view(torch.int16).to(torch.int32).view(n, k // 32, 32) & 0xFFFF
    e = (u >> 7) & 0xFF
    high = e >> 1
    low = ((e & 1) << 7) | (u & 0x7F)
    hb = high.amax(-1)
    d = hb[..., None] - high
    fits = d.amax(-1) <= _MAX_D
    code = ((u >> 15) << 3) | d.clamp(max=_MAX_D)
    low, code = low[..., _COLUMN], code[..., _COLUMN]
    nibbles = code[..., :16] | (code[..., 16:] << 4)
    where = (~fits).nonzero()
    # a raw block's nibble bytes hold its index in `raw` (int32, little-endian as x86 reads it)
    idx = torch.arange(base, base + where.shape[0], dtype=torch.int32).view(-1, 1)
    nibbles[where[:, 0], where[:, 1], :4] = idx.view(torch.uint8).to(torch.int32)
    blocks[..., :32] = low
    blocks[..., 32:] = nibbles
    hb_out.copy_(torch.where(fits, hb, torch.full_like(hb, _RAW)))
    return w.reshape(n, k // 32, 32)[where[:, 0], where[:, 1]]


def panel_order(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (N % 16 == 0, K even) in the panel GEMM's order, one row a panel of 16
    outputs ([N / 16, 16 K]): per k pair, the 16 outputs' weights at k even, then at k odd.
    `pack_compact` of it makes each block one k pair of one panel, which the kernel decodes
    into the vectors `vx_gemm_panels_avx2` widens from its panel's words."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 2, 2).permute(0, 2, 3, 1).reshape(n // 16, 16 * k)


class CompactWeight:
    """The compact copy of one bf16 [N, K] weight and its GEMM with 1 to `max_rows` bf16 rows.

    Invariant: `apply(x, bias)` is `vx_gemm_panels_avx2(x, W's panels, bias)`, bit for bit
    (per output one fp32 FMA chain over k in order: a row's bits do not depend on the rows
    beside it, at any row count of the panel GEMM), or None where the kernel declines (more
    rows, a strided or non-bf16 x: the caller's path then).
    """

    def __init__(self, lib, weight: torch.Tensor) -> None:
        self._lib = lib
        self.n, self.k = weight.shape
        self.blocks, self.hb, self.raw = pack_compact(panel_order(weight))
        self.max_rows = int(lib.vx_compact_max_rows())

    @staticmethod
    def _takes(lib, weight: torch.Tensor) -> bool:
        if lib is None or not envs.VX_CPU_COMPACT:
            return False
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return False
        if weight.shape[0] % 16 or weight.shape[1] % 2:
            return False
        return weight.shape[1] <= 16384 and bool(lib.vx_compact_max_rows())

    @classmethod
    def maybe(cls, lib, weight: torch.Tensor) -> CompactWeight | None:
        """The copy, or None where the kernel is not built here, N % 16, K odd, or
        `VX_CPU_COMPACT=0`."""
        return cls(lib, weight.detach()) if cls._takes(lib, weight) else None

    @classmethod
    def maybe_size(cls, lib, weight: torch.Tensor) -> int:
        """The bytes `maybe` would hold (its raw blocks aside), 0 where it would make none."""
        return weight.numel() * 49 // 32 if cls._takes(lib, weight) else 0

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        m = x.shape[0]
        if not 0 < m <= self.max_rows or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
            return None
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return None
        y = torch.empty(m, self.n, dtype=torch.bfloat16)
        rc = self._lib.vx_gemv_compact_avx2(
            x.data_ptr(), x.stride(0), m, self.blocks.data_ptr(), self.hb.data_ptr(),
            self.raw.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            self.n, self.n, self.k,
        )  # fmt: skip
        if rc == -3:
            raise MemoryError("vx compact GEMM could not allocate scratch")
        return y if rc == 0 else None
