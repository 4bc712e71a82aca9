"""bf16 weights packed for vx's VNNI-layout GEMM, on AVX512-BF16 CPUs without AMX (AMD Zen 4
and 5, Intel Cooper Lake).

Runs in: each Worker process.

Why: on such a CPU oneDNN's bf16 GEMM (the prepacked one included) ran SmolLM2's 120
matrices well below `vdpbf16ps`'s peak on two Zen 5 cores from 16 to 128 rows; vx's kernel
(`vx/gpu/cpu/csrc/gemm_vnni.c`), on weights laid out once at load time, was ahead of it
there and level from 256 rows up (measured on those matrices). With its small-row loop it is
level with the skinny GEMM (plain weights, `vdpbf16ps` with a reduction per output) at 1-2
rows too, so it takes every row count (`VNNI_MIN_ROWS`): each output's sum runs over k in one
order whatever the rows, so a row's bits never depend on the rows beside it (speculative
decoding's scored rows against one-row steps), as on AMX. A layer with the VNNI copy needs no
oneDNN copy: the memory is what it was (the plain weight, for the screen and the weights the
copy does not take, and one packed copy).

The results are the GEMM's up to the order of the fp32 sums (bf16 products are exact in fp32,
one rounding to bf16 at the end). `VX_CPU_PREPACK=0` leaves both out (plain weights,
F.linear).

On AMX CPUs the same packed layout is exactly the B tiles of an AMX product, and
`vx_gemm_amx_vnni` (`vx/gpu/cpu/csrc/gemm_amx_vnni.c`) takes the linears' rows from
`amx_vnni_rows()[0]` to `[1]` (1-2,048; see `amx_vnni_wanted`). At 1-192 rows it gives
bit-identical results to the AMX skinny GEMM on the plain weight in less time (cold
weights, measured on a 2-core Sapphire Rapids), and at 1-2 rows it is level with the
VDPBF16PS GEMV, which it replaces there so that a row's bits never depend on the rows beside
it (speculative decoding's scored rows against one-row steps). At 193-2,048 rows it takes a shape's rows
where the load-time timing (`vx.gpu.cpu.row_plan.tune_vnni`) found it ahead of oneDNN under
the row plan (on SmolLM2: o and down up to 1,024 rows, qkv at some sizes). There a layer
keeps all three copies: the plain weight (the fused step's description), the VNNI copy, and
oneDNN's (past 2,048 rows, and the sizes it wins).

A gate-up read through its SiLU (`MergedColumnParallelLinear(silu_pairs=True)`, no bias)
instead keeps the plain weight and a copy packed with its gate and up rows interleaved
(`VnniWeight(silu=True)`), for `vx_gemm_amx_vnni_silu`: the GEMM with silu(gate) * up in its
epilogue, from one row at any count, the bits of the GEMM then the SiLU pass; no oneDNN copy.
`VX_CPU_AMX_VNNI=0` leaves it out (A/B timing).
"""

from __future__ import annotations

import numpy as np
import torch

from vx import envs
from vx.gpu.cpu.ops import AMX_MAX_ROWS, gemv_fits, gemv_kernels
from vx.gpu.cpu.row_plan import vnni_wins

__all__ = [
    "VNNI_MIN_ROWS",
    "VnniWeight",
    "amx_vnni_rows",
    "amx_vnni_wanted",
    "silu_packable",
    "vnni_takes",
    "vnni_wanted",
]

#: Rows from which a layer with a VNNI copy takes it rather than the skinny GEMM on its plain
#: weight: every row count, so that a row's bits do not depend on the step's rows (the GEMM's
#: small-row loop, `vx/gpu/cpu/csrc/gemm_vnni.c`, is level with the skinny GEMM at one row:
#: `bench/vnni_rows.py`, SmolLM2's matrices with cold weights, 2-core Sapphire Rapids with AMX
#: off; before it, a 2-core Zen 5 had the skinny GEMM ahead at one row).
VNNI_MIN_ROWS = 1

_state: dict[str, object] = {}


def _kernels(amx: bool):
    """The kernel library where it has the VNNI GEMM for this kind of CPU, else None: `amx`
    False, the VDPBF16PS one where AMX is not on (there vx's AMX GEMMs and oneDNN's are
    faster); True, the AMX one where AMX is on."""
    key = "amx" if amx else "lib"
    if key not in _state:
        lib = gemv_kernels()
        ok = (
            lib is not None
            and (not amx or envs.VX_CPU_AMX_VNNI)
            and bool(lib.vx_fast_amx(-1)) == amx
            and bool(lib.vx_has_gemm_amx_vnni() if amx else lib.vx_has_gemm_vnni())
        )
        _state[key] = lib if ok else None
    return _state[key]


def _lib():
    return _kernels(False)


def _amx_lib():
    return _kernels(True)


def amx_vnni_rows() -> tuple[int, int]:
    """(first, last) row counts the AMX VNNI GEMM takes a linear's x for (C's constants, which
    the fused decode step routes by too)."""
    if "amx_rows" not in _state:  # asked on every linear's call: once
        lib = _amx_lib()
        _state["amx_rows"] = (
            (0, -1) if lib is None else (lib.vx_amx_vnni_rows(0), lib.vx_amx_vnni_rows(1))
        )
    return _state["amx_rows"]  # type: ignore[return-value]


def amx_vnni_wanted(weight: torch.Tensor) -> bool:
    """Whether a linear's `weight` [N, K] (CPU bf16, N % 16 == 0, K % 32 == 0) gets a VNNI
    copy for the AMX GEMM here (AMX on; prepacking on)."""
    return _packable(weight) and weight.shape[1] <= 16384 and _amx_lib() is not None


def silu_packable(weight: torch.Tensor) -> bool:
    """Whether a gate-up `weight` [2I, K] can have the AMX SiLU copy (`VnniWeight(silu=True)`):
    an AMX VNNI copy at all, and I % 16 == 0."""
    return amx_vnni_wanted(weight) and weight.shape[0] % 32 == 0


def _packable(weight: torch.Tensor) -> bool:
    """CPU bf16 [N, K] with N % 16 == 0 and K % 32 == 0, and packed copies not turned off."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and envs.VX_CPU_PREPACK  # no packed copies at all
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 32 == 0
    )


def vnni_wanted(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] (CPU bf16, N % 16 == 0, K % 32 == 0) gets a VNNI copy here."""
    return _packable(weight) and _lib() is not None


def vnni_takes(vnni: VnniWeight | None, x: torch.Tensor, plain: torch.Tensor | None) -> bool:
    """Whether x @ W.T goes to the VNNI copy `vnni`: 2-D bf16 x of at least `VNNI_MIN_ROWS`
    rows, or any rows the skinny GEMM on `plain` does not take; any rows for an `all_rows`
    copy (with AMX, the AMX GEMM's rows otherwise)."""
    if vnni is None or vnni.silu or x.dim() != 2 or x.dtype != torch.bfloat16:
        return False
    if vnni.all_rows:
        return True
    if vnni.amx:
        lo, hi = amx_vnni_rows()
        m = x.shape[0]
        if not lo <= m <= hi:
            return False
        # past the skinny GEMM's rows: where it beats oneDNN for this shape (measured at load)
        return m <= AMX_MAX_ROWS or vnni_wins(vnni.n, vnni.k, m)
    return x.shape[0] >= VNNI_MIN_ROWS or plain is None or not gemv_fits(x, plain)


class VnniWeight:
    """`weight` [N, K] packed for `vx_gemm_vnni_bf16` (see `vnni_wanted`), or with `amx` for
    `vx_gemm_amx_vnni` (the same layout; see `amx_vnni_wanted`); `apply(x, bias)` is
    x @ weight.T + bias in bf16 for bf16 x [M, K] with unit column stride.

    With `silu` (AMX only) `weight` is a gate-up [gate; up] ([2I, K], I % 16 == 0), packed with
    its gate and up rows interleaved by 16 for `vx_gemm_amx_vnni_silu`: `apply_silu(x)` is
    silu(x @ gate.T) * (x @ up.T) [M, I] with the roundings of `apply` then SiLU-mul (the same
    bits), and `apply` does not apply."""

    def __init__(
        self, weight: torch.Tensor, amx: bool = False, silu: bool = False, all_rows: bool = False
    ) -> None:
        """amx: for `vx_gemm_amx_vnni` (see `amx_vnni_wanted`), else `vx_gemm_vnni_bf16`;
        silu: a gate-up weight for `vx_gemm_amx_vnni_silu` (see `silu_packable`); all_rows:
        the copy takes every row count (`--batch-invariant`: one GEMM, whose sums run over k in
        one order whatever the rows, so a row's bits do not depend on the rows beside it)."""
        n, k = weight.shape
        self.n, self.k = n, k
        self.amx = amx
        self.silu = silu
        self.all_rows = all_rows
        if silu and not (amx and silu_packable(weight)):
            raise ValueError(f"a {n} x {k} weight cannot be packed for the SiLU GEMM")
        lib = _amx_lib() if amx else _lib()
        w = weight.detach().contiguous()
        if silu:  # rows gate 0-15, up 0-15, gate 16-31, ...: each 32 columns one gate | up pair
            w = w.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)
        # [N / 16, K / 2, 16] dwords; 64-byte aligned rows come from torch's CPU allocator
        # (its allocations are 64-byte aligned), and each panel row is 64 bytes.
        self.packed = torch.empty(n // 16, k // 2, 16, dtype=torch.int32)
        if self.packed.data_ptr() % 64:
            raise RuntimeError("the VNNI weight copy is not 64-byte aligned")
        rc = lib.vx_pack_vnni_bf16(w.data_ptr(), n, k, self.packed.data_ptr())  # type: ignore[union-attr]
        if rc != 0:
            raise ValueError(f"vx could not pack a {n} x {k} weight for the VNNI GEMM")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.silu:
            raise RuntimeError("a SiLU-packed gate-up weight is read by apply_silu only")
        if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.contiguous()
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return self.apply(x, None) + bias
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.bfloat16)
        lib = _amx_lib() if self.amx else _lib()
        fn = lib.vx_gemm_amx_vnni if self.amx else lib.vx_gemm_vnni_bf16  # type: ignore[union-attr]
        rc = fn(
            x.data_ptr(), x.stride(0), m, self.packed.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), self.n, self.n, self.k,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"vx VNNI GEMM refused {tuple(x.shape)} @ ({self.n}, {self.k})")
        return y

    def apply_rope(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope_n: int,
        head_dim: int,
    ) -> torch.Tensor | None:
        """`apply(x, bias)` [M, N] with rotate-half rotary on its columns [0, rope_n) (heads of
        `head_dim`; cos/sin bf16 [M, 1, head_dim / 2] as `rotary.apply_rotary` takes them),
        by the AMX GEMM's epilogue: the bits of `apply` then `apply_rotary`. None where it does
        not apply (not an AMX copy, AMX off, the shapes: the caller does the two steps)."""
        m = x.shape[0]
        if (
            not self.amx
            or self.silu
            or cos.dtype != torch.bfloat16
            or sin.dtype != torch.bfloat16
            or cos.shape != (m, 1, head_dim // 2)
            or sin.shape != cos.shape
            or not cos.is_contiguous()
            or not sin.is_contiguous()
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))
        ):
            return None
        if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.contiguous()
        y = torch.empty(m, self.n, dtype=torch.bfloat16)
        rc = _amx_lib().vx_gemm_amx_vnni_rope(  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), m, self.packed.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), self.n, self.n, self.k,
            cos.data_ptr(), sin.data_ptr(), rope_n, head_dim,
        )  # fmt: skip
        if rc == -2:
            return None
        if rc != 0:
            raise RuntimeError(f"vx rotary GEMM refused {tuple(x.shape)} @ ({self.n}, {self.k})")
        return y

    def apply_silu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x @ gate.T) * (x @ up.T), bf16 [M, I], for a `silu` weight (no bias); None
        where AMX was switched off since (`vx_fast_amx`: A/B timing, tests)."""
        if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.contiguous()
        m, i = x.shape[0], self.n // 2
        y = torch.empty(m, i, dtype=torch.bfloat16)
        rc = _amx_lib().vx_gemm_amx_vnni_silu(  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), m, self.packed.data_ptr(), None, y.data_ptr(), i, i, self.k
        )
        if rc == -2:
            return None
        if rc != 0:
            raise RuntimeError(f"vx SiLU GEMM refused {tuple(x.shape)} @ ({self.n}, {self.k})")
        return y

    def argmax(self, x: torch.Tensor) -> np.ndarray:
        """[M] int64: the first maximum over n of `apply(x, None)` [M, N] (its bf16 values),
        without forming the [M, N] product (greedy rows from the LM head)."""
        if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.contiguous()
        out = np.empty(x.shape[0], dtype=np.int64)
        rc = _lib().vx_argmax_vnni_bf16(  # type: ignore[union-attr]
            x.data_ptr(), x.stride(0), x.shape[0], self.packed.data_ptr(), self.n, self.k,
            out.ctypes.data,
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("vx VNNI argmax could not allocate scratch")
        if rc != 0:
            raise RuntimeError(f"vx VNNI argmax refused {tuple(x.shape)} @ ({self.n}, {self.k})")
        return out
