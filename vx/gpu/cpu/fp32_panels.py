"""fp32 weights for the row-invariant fp32 GEMM (`--batch-invariant` on an fp32 model).

Runs in: each Worker process.

torch's fp32 GEMM (oneDNN, MKL) picks its kernel and its blocking of k by the number of rows,
so a row's outputs change with the rows beside it. vx's panel GEMM
(`vx/gpu/cpu/csrc/gemm_f32.c`) sums each output over k in order, one FMA chain from 0, so a
row's bits are the same in any batch. It needs AVX2 and FMA (x86-64-v3 and later).
"""

from __future__ import annotations

import torch

from vx.gpu.cpu.library import load_cpu_kernels

__all__ = ["Fp32Panels", "fp32_panels_wanted"]


def fp32_panels_wanted(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] (CPU fp32, N % 16 == 0) can have the panel copy here."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if weight.shape[0] % 16 or weight.shape[0] == 0 or weight.shape[1] == 0:
        return False
    lib = load_cpu_kernels()
    return lib is not None and bool(lib.vx_has_gemm_f32_panels())


class Fp32Panels:
    """`weight` [N, K] fp32 as the panel GEMM reads it ([N / 16, K, 16]: panel p, row k,
    column j holds W[16 p + j, k]); `apply(x, bias)` is x @ W.T + bias, fp32, for x of any
    rows: each output its row's fp32 sum over k in order, plus the bias.

    Invariant: a row's result does not depend on the other rows of x (see the module)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not fp32_panels_wanted(weight):
            raise ValueError(f"no fp32 panel GEMM here for a {tuple(weight.shape)} weight")
        n, k = weight.shape
        self.n, self.k = n, k
        self._lib = load_cpu_kernels()
        # torch's CPU allocator aligns to 64 bytes: the kernel's 32-byte aligned loads
        self.panels = weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()
        if self.panels.data_ptr() % 32:
            raise RuntimeError("the fp32 panel copy is not 32-byte aligned")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        y = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        if x2.shape[0]:
            rc = self._lib.vx_gemm_f32_panels(  # type: ignore[union-attr]
                x2.data_ptr(), x2.stride(0), x2.shape[0], self.panels.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), self.n, self.n, self.k,
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"vx fp32 panel GEMM refused its arguments ({rc})")
        return y.view(*lead, self.n).to(x.dtype)
