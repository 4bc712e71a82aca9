"""The Python side of vx's C CPU ops beside the attention kernel: the skinny GEMM (decode at
small batch, bf16 or int8 weights) and the fused RMSNorm and SiLU-mul (bf16).

Runs in: each Worker process. The C sources are `vx/gpu/cpu/csrc/gemv.c` and `vx/gpu/cpu/csrc/eltwise.c`, built into the same
library as the decode attention (`vx.gpu.cpu.library.load_cpu_kernels`). Every entry point
answers "not here" (False / None) where the library, the CPU or the tensor does not fit, and
the caller keeps its torch path (as everywhere with `VX_CPU_ATTENTION_KERNEL=0`, which
turns the library off).
"""

from __future__ import annotations

import numpy as np
import torch

from vx.gpu.cpu.library import load_cpu_kernels

__all__ = [
    "AMX_MAX_ROWS",
    "GEMV_MAX_ROWS_INT8",
    "bf16_max_rows",
    "fused_add_rms_norm",
    "fused_gelu_tanh_and_mul",
    "fused_rotary",
    "fused_silu_and_mul",
    "gemv_fits",
    "gemv_kernels",
    "skinny_argmax",
    "skinny_gemm",
]

#: Rows up to which vx's C kernels (`vx/gpu/cpu/csrc/gemv.c`) replace the library GEMM, as
#: measured on the full SmolLM2 set of matrices with cold weights (2-core Sapphire Rapids);
#: each cap is the last row count where the kernel was still ahead:
#: - int8 weights: ahead of torch's `_weight_int8pack_mm` at 1-8 rows;
#: - bf16 on AMX tiles (`vx_gemm_amx_bf16`, up to 192 rows a call): ahead of oneDNN's packed
#:   GEMM through 192 rows, behind at 256; it takes every row count from one, though
#:   VDPBF16PS (`vx_gemv_bf16`) is a little ahead at 1-2 rows, so that a row's bits never
#:   depend on the rows beside it (speculative decoding's scored rows against one-row steps);
#: - bf16 without AMX: VDPBF16PS ahead of oneDNN through 12 rows, behind at 16; without
#:   AVX512-BF16 (fp32 FMAs) ahead through 4 rows, a tie at 8.
GEMV_MAX_ROWS_INT8 = 8
AMX_MAX_ROWS = 192
_DP_MAX_ROWS = 12
_FMA_MAX_ROWS = 4
#: Rows up to which VDPBF16PS takes bf16 weights where AMX is on: none (see above).
_DP_PREFERRED_ROWS = 0

_SCALAR_SILU_ROWS = 8

_gemv_state: dict[str, object] = {}


def gemv_kernels():
    """The loaded C library when it has the skinny GEMM (AVX-512 CPUs), else None (then
    oneDNN / torch's int8 kernel take every size)."""
    if "lib" not in _gemv_state:
        lib = load_cpu_kernels()
        if lib is not None and not lib.vx_has_gemv():
            lib = None
        amx = lib is not None and bool(lib.vx_fast_amx(-1))
        dp = lib is not None and lib.vx_gemv_bf16_max_rows() >= 16  # the VDPBF16PS kernel
        _gemv_state["amx"] = amx
        _gemv_state["bf16_rows"] = (
            0 if lib is None else AMX_MAX_ROWS if amx else _DP_MAX_ROWS if dp else _FMA_MAX_ROWS
        )
        _gemv_state["lib"] = lib
    return _gemv_state["lib"]


def bf16_max_rows() -> int:
    """Rows up to which `skinny_gemm` takes bf16 weights here (0: never)."""
    gemv_kernels()
    return _gemv_state["bf16_rows"]  # type: ignore[return-value]


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether `skinny_gemm` takes x @ weight.T: CPU, bf16 x of at most `max_rows` rows (and
    at most what the kernels here take for the weight's dtype), K a multiple of 32, and for
    bf16 weights on AMX N a multiple of 16."""
    if not (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.shape[1] % 32 == 0
        and weight.shape[1] <= 16384
        and gemv_kernels() is not None
    ):
        return False
    rows = x.shape[0]
    limit = GEMV_MAX_ROWS_INT8 if weight.dtype == torch.int8 else bf16_max_rows()
    if max_rows is not None:
        limit = min(limit, max_rows)
    if not 0 < rows <= limit:
        return False
    if weight.dtype == torch.bfloat16 and rows > _DP_PREFERRED_ROWS and _gemv_state["amx"]:
        return weight.shape[0] % 16 == 0 or rows <= _DP_MAX_ROWS
    return True


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] bf16 @ weight [N, K] (int8 with per-row `scales`, or bf16).T + bias, bf16.

    The caller checks `gemv_fits` first; weight, scales and bias are contiguous.
    """
    lib = gemv_kernels()
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return skinny_gemm(x, weight, scales, None) + bias
    if x.stride(1) != 1:
        x = x.contiguous()
    m, (n, k) = x.shape[0], weight.shape
    y = torch.empty(m, n, dtype=torch.bfloat16)
    b = None if bias is None else bias.data_ptr()
    rc = -1
    if weight.dtype == torch.int8:
        fn = lib.vx_gemv_int8  # type: ignore[union-attr]
        rc = fn(x.data_ptr(), x.stride(0), m, weight.data_ptr(), scales.data_ptr(), b,  # type: ignore[union-attr]
                y.data_ptr(), n, n, k)  # fmt: skip
    else:
        if m > _DP_PREFERRED_ROWS and _gemv_state["amx"]:
            rc = lib.vx_gemm_amx_bf16(  # type: ignore[union-attr]
                x.data_ptr(), x.stride(0), m, weight.data_ptr(), b, y.data_ptr(), n, n, k
            )
        if rc != 0:
            rc = lib.vx_gemv_bf16(  # type: ignore[union-attr]
                x.data_ptr(), x.stride(0), m, weight.data_ptr(), None, b, y.data_ptr(), n, n, k
            )
    if rc != 0:
        raise RuntimeError(f"vx skinny GEMM refused {tuple(x.shape)} @ {tuple(weight.shape)}")
    return y


def skinny_argmax(x: torch.Tensor, weight: torch.Tensor) -> np.ndarray | None:
    """argmax over n of `skinny_gemm(x, weight)` [M, N] (its bf16 values, the first maximum),
    without the [M, N] product: the greedy tokens straight from the LM head. None where
    `skinny_gemm` would not take the AMX kernel for x (the caller computes the logits).
    """
    m, (n, k) = x.shape[0], weight.shape
    if not (gemv_fits(x, weight) and m > _DP_PREFERRED_ROWS and _gemv_state["amx"]):
        return None
    if weight.dtype != torch.bfloat16 or not weight.is_contiguous() or x.stride(1) != 1:
        return None
    out = np.empty(m, dtype=np.int64)
    rc = gemv_kernels().vx_argmax_amx_bf16(  # type: ignore[union-attr]
        x.data_ptr(), x.stride(0), m, weight.data_ptr(), n, k, out.ctypes.data
    )
    if rc == -1:
        raise MemoryError("vx skinny argmax could not allocate scratch")
    return out if rc == 0 else None


def eltwise_kernels():
    """The loaded C library for the element-wise kernels (RMSNorm, SiLU-mul, rotary: portable
    C, on every CPU the library builds on), else None (then the torch ops)."""
    if "eltwise" not in _gemv_state:
        _gemv_state["eltwise"] = load_cpu_kernels()
    return _gemv_state["eltwise"]


def _cpu_bf16_rows(x: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and (x.stride(-1) == 1)
    )


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """RMSNorm (with the residual add) in one C call for CPU bf16 rows, HF's roundings (Llama's,
    or with `gemma` Gemma's: `(1 + w)` multiplied in fp32); None where it does not apply (the
    caller runs the torch ops). One call instead of ~9 torch ops per norm, whose dispatch was
    a sizeable share of a batch-1 step on SmolLM2."""
    lib = eltwise_kernels()
    if lib is None or not _cpu_bf16_rows(x) or weight.dtype != torch.bfloat16:
        return None
    if residual is not None and not (_cpu_bf16_rows(residual) and residual.is_contiguous()):
        return None
    t, h = x.shape
    out = torch.empty(t, h, dtype=torch.bfloat16)
    r_out = None if residual is None else torch.empty(t, h, dtype=torch.bfloat16)
    fn = lib.vx_gemma_rms_norm_bf16 if gemma else lib.vx_add_rms_norm_bf16  # type: ignore[union-attr]
    fn(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        None if r_out is None else r_out.data_ptr(), weight.data_ptr(), out.data_ptr(), t, h, eps,
    )  # fmt: skip
    return out, r_out


def fused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up in one C call for CPU bf16 rows (torch's roundings), else None. Where
    the C loop is scalar (no AVX512-BF16), only for up to `_SCALAR_SILU_ROWS` rows: past them
    torch's two vectorised ops are ahead (measured at 64 SmolLM2 rows, AVX2)."""
    return _gated_and_mul(gate_up, "vx_silu_and_mul_bf16")


def fused_gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up (GeGLU) in one C call for CPU bf16 rows (torch's formula and its two
    bf16 roundings), else None. As `fused_silu_and_mul`, only for up to `_SCALAR_SILU_ROWS` rows
    where the C loop is scalar."""
    return _gated_and_mul(gate_up, "vx_gelu_tanh_and_mul_bf16")


def _gated_and_mul(gate_up: torch.Tensor, kernel: str) -> torch.Tensor | None:
    """act(gate) * up for gate_up [T, 2I] by the C `kernel` (one of the two above), or None."""
    lib = eltwise_kernels()
    if lib is None or not _cpu_bf16_rows(gate_up):
        return None
    if gate_up.shape[0] > _SCALAR_SILU_ROWS and not lib.vx_silu_simd():
        return None
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.bfloat16)
    getattr(lib, kernel)(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, i)
    return out


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half rotary IN PLACE on CPU bf16 x [T, H, D] (heads D apart in each row) with
    cos/sin [T, 1, D / 2], torch's roundings, one C call; False where it does not apply (the
    caller runs the torch ops). Instead of five torch ops and their temporaries per layer."""
    lib = eltwise_kernels()
    if lib is None or x.dim() != 3 or x.dtype != torch.bfloat16:
        return False
    t, h, d = x.shape
    if x.device.type != "cpu" or x.stride(2) != 1 or x.stride(1) != d or d % 2:
        return False
    c, s = cos.reshape(t, d // 2), sin.reshape(t, d // 2)
    if not (c.dtype == s.dtype == torch.bfloat16 and c.is_contiguous() and s.is_contiguous()):
        return False
    lib.vx_rotary_bf16(x.data_ptr(), x.stride(0), t, h, d, c.data_ptr(), s.data_ptr())  # type: ignore[union-attr]
    return True


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """RMSNorm over each head of CPU bf16 x [T, H, D] (heads D apart in each row) IN PLACE with
    one weight [D], HF Llama's roundings (`fused_add_rms_norm`'s), one C call; False where it
    does not apply (the caller runs the torch ops). Qwen3's q / k norms on the qkv GEMM's own
    output: no copies of the heads, no concatenation after them."""
    lib = eltwise_kernels()
    if lib is None or x.dim() != 3 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or weight.dtype != torch.bfloat16:
        return False
    if not weight.is_contiguous() or weight.shape != (d,):
        return False
    lib.vx_head_rms_norm_bf16(x.data_ptr(), x.stride(0), t, h, d, weight.data_ptr(), eps, 0)  # type: ignore[union-attr]
    return True
