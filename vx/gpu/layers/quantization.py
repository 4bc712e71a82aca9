"""How a linear's weight is stored and multiplied on CPU: oneDNN prepacking, and the opt-in
weight-only int8 / int4 modes (`--quantization`).

Runs in: each Worker process.

bf16 (default): a CPU bf16 weight is reordered once into oneDNN's blocked layout and every
call goes through `mkldnn::_linear_pointwise` (see `cpu_prepack_enabled`).

Weight-only quantization (`QuantizedWeight`): the weight is also quantized with torch's own CPU
kernels, int8 per output channel (symmetric, `aten._weight_int8pack_mm`) or int4 in groups of
`INT4_GROUP_SIZE` input features (asymmetric min/max, `aten._weight_int4pack_mm_for_cpu`).
These kernels read half / a quarter of the bytes of a bf16 GEMV, but they dequantize in fp32
vector code, so past a few rows the AMX bf16 GEMM leaves them far behind. A quantized layer
therefore keeps its (prepacked) model-dtype weight as well and takes the quantized path only
for `x` of at most `max_rows` rows (decode at small batch, where the step is weight-streaming
bound); prefill and larger decode batches keep bf16 numerics. This trades memory (weights +
int8 copy) for speed: the point of the mode on CPU is the decode step time, not the footprint.
`VX_QUANT_MAX_ROWS` overrides `max_rows` (a large value forces the quantized path everywhere,
e.g. to measure the accuracy of the pure quantized model).
"""

from __future__ import annotations

import logging

import torch

from vx import envs
from vx.gpu.cpu.emulate import emulating
from vx.gpu.cpu.ops import (
    AMX_MAX_ROWS,
    GEMV_MAX_ROWS_INT8,
    bf16_max_rows,
    gemv_fits,
    gemv_kernels,
    skinny_gemm,
)
from vx.gpu.cpu.widen import (
    Int4Avx2,
    avx2_int8_gemm,
    avx2_int8_rows,
    pack_int8_avx2,
)

logger = logging.getLogger(__name__)

__all__ = [
    "INT4_GROUP_SIZE",
    "QUANTIZATIONS",
    "QuantizedWeight",
    "cpu_prepack_enabled",
    "prepack",
    "prepack_batch_hint",
    "quantize_int4",
    "quantize_int8",
    "validate_quantization",
]

#: The values `--quantization` accepts (None: the model dtype, no quantization).
QUANTIZATIONS = ("int8", "int4")
#: Input features per int4 scale/zero pair (SmolLM2's GGUF source is q4_1, also groups of 32).
INT4_GROUP_SIZE = 32
#: Rows up to which the quantized kernels beat the prepacked bf16 GEMM on a 2-core Sapphire
#: Rapids (measured per SmolLM2 shape: int8 wins clearly at 1 row, roughly ties at 2-4, and
#: falls further behind from 8 rows on).
DEFAULT_QUANT_MAX_ROWS = 4

#: Rows up to which vx's AVX2 int4 kernel takes a layer: it widens the nibbles again for every
#: two rows of x, so past that the AVX2 bf16 GEMM is ahead (measured on SmolLM2's 120
#: linears, weights cold, on a 2-core AMD EPYC Zen 3: the int4 kernel beats bf16 at 1 and 2
#: rows, not from 4). The int8 kernel keeps `GEMV_MAX_ROWS_INT8`.
AVX2_INT4_MAX_ROWS = 2

#: oneDNN picks the packed layout for this many rows. Where vx's own AMX GEMM takes every step
#: of up to `AMX_MAX_ROWS` rows (`vx.gpu.cpu.ops.skinny_gemm`), oneDNN sees only longer ones
#: (prefill), and a layout picked for 256 rows runs those ahead of one picked for a single
#: row (measured on gate-up at 256-2,048 rows, the other projections the same); elsewhere oneDNN
#: also takes small decode batches, which the single-row layout suits.
_PREPACK_BATCH_HINT_LARGE = 256
_PREPACK_BATCH_HINT_SMALL = 1


def validate_quantization(quantization: str | None, device: torch.device | str) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; vx supports {QUANTIZATIONS}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization} is implemented for CPU only")


def cpu_prepack_enabled(weight: torch.Tensor) -> bool:
    """Whether a bf16 CPU weight should be reordered into oneDNN's blocked layout.

    NOTE: at M <= 64 rows a prepacked bf16 GEMM beats `F.linear` on the same weight (which
    reorders on every call; measured), with bit-identical results at decode sizes.
    `VX_CPU_PREPACK=0` turns it off (e.g. to trace the model with torch.compile), and so does
    the emulation (`vx.gpu.cpu.emulate.emulating`: the emulated CPU's layers route the same on
    every host, and an AVX2 host's oneDNN has no bf16 GEMM).
    """
    return (
        weight.device.type == "cpu"
        and not emulating()
        and weight.dtype == torch.bfloat16
        and envs.VX_CPU_PREPACK
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def prepack_batch_hint() -> int:
    """The rows oneDNN lays a prepacked weight out for here (see `_PREPACK_BATCH_HINT_LARGE`)."""
    if bf16_max_rows() >= AMX_MAX_ROWS:
        return _PREPACK_BATCH_HINT_LARGE
    return _PREPACK_BATCH_HINT_SMALL


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] reordered into oneDNN's blocked layout (an opaque mkldnn tensor), laid
    out for `prepack_batch_hint()` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), prepack_batch_hint())


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], scales [N] in weight's dtype), symmetric per output channel.

    The values are rounded against the scale as stored (in the model dtype), so that
    `q * scales[:, None]` is exactly the weight the kernel multiplies by.
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10).to(weight.dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (q int32 [N, K] in 0..15, scales, zeros [N, K // group_size] in weight's dtype).

    Asymmetric per group: w ~ (q - 8) * scale + zero (the convention of torch's int4 kernel),
    with scale = (max - min) / 15 and zero = min + 8 * scale, both rounded to the model dtype
    before the values are rounded against them.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4: {k} input features are not a multiple of {group_size}")
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-10).to(weight.dtype)
    zeros = (lo + 8.0 * scales.float()).to(weight.dtype)
    s, z = scales.float()[..., None], zeros.float()[..., None]
    q = torch.round((w - z) / s + 8.0).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scales, zeros


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> torch.Tensor:
    """The fp32 weight `quantize_int4`'s output stands for (the tests' reference)."""
    n, k = q.shape
    g = q.view(n, k // group_size, group_size).float() - 8.0
    return (g * scales.float()[..., None] + zeros.float()[..., None]).view(n, k)


class QuantizedWeight:
    """A weight-only quantized copy of one [N, K] weight and its matmul.

    Invariants: `apply(x)` is x @ W_q.T (+ bias) for the dequantized W_q, in x's dtype;
    `max_rows` bounds the rows the caller should send here (more go to the dense weight).
    """

    def __init__(self, weight: torch.Tensor, method: str) -> None:
        self.method = method
        self.out_features, self.in_features = weight.shape
        max_rows = envs.VX_QUANT_MAX_ROWS
        avx2 = gemv_kernels() is None and weight.dtype == torch.bfloat16 and avx2_int8_rows() > 0
        #: the int8 weight in the layout of vx's AVX2 kernel (AVX2 CPUs without AVX-512), else
        #: None; `qweight` stays for torch's kernel past that kernel's rows
        self.avx2_qweight: torch.Tensor | None = None
        #: the int4 weight in the layout of vx's AVX2 kernel (AVX2 CPUs without AVX-512), else None
        self.avx2_int4: Int4Avx2 | None = None
        if method == "int8":
            self.qweight, self.scales = quantize_int8(weight)
            if avx2:
                self.avx2_qweight = pack_int8_avx2(self.qweight)
        elif method == "int4":
            q, scales, zeros = quantize_int4(weight)
            if avx2 and Int4Avx2.takes(self.in_features):
                self.avx2_int4 = Int4Avx2(q, scales, zeros)
            # [K / group, N, 2] (scale, zero) pairs, the layout the CPU kernel reads.
            self.scales = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
            self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            raise ValueError(f"unknown quantization {method!r}")
        # vx's C kernels: the AVX-512 int8 one, or the AVX2 int8 / int4 ones where built
        c_int8 = method == "int8" and weight.dtype == torch.bfloat16 and gemv_kernels() is not None
        if c_int8 or self.avx2_qweight is not None:
            default = GEMV_MAX_ROWS_INT8
        elif self.avx2_int4 is not None:
            default = AVX2_INT4_MAX_ROWS
        else:
            default = DEFAULT_QUANT_MAX_ROWS
        self.max_rows = default if max_rows is None else max_rows

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != self.scales.dtype:
            raise TypeError(f"quantized linear: input {x.dtype}, weight {self.scales.dtype}")
        if self.method == "int8" and gemv_fits(x, self.qweight, GEMV_MAX_ROWS_INT8):
            return skinny_gemm(x, self.qweight, self.scales, bias)
        if self.method == "int8":
            if self.avx2_qweight is not None:  # AVX2 CPUs
                y = avx2_int8_gemm(x, self.avx2_qweight, self.scales, bias)
                if y is not None:
                    return y
            out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        else:
            if self.avx2_int4 is not None:  # AVX2 CPUs
                y = self.avx2_int4.apply(x, bias)
                if y is not None:
                    return y
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.qweight, INT4_GROUP_SIZE, self.scales
            )
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        avx2 = 0 if self.avx2_qweight is None else self.avx2_qweight.nbytes
        if self.avx2_int4 is not None:
            a = self.avx2_int4
            avx2 = a.q.nbytes + a.s.nbytes + a.z.nbytes
        return self.qweight.nbytes + avx2 + self.scales.nbytes
