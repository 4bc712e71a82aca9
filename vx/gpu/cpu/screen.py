"""Exact greedy tokens from a bf16 LM head with half its bytes read (CPUs with AVX2 or
AVX512-BF16).

Runs in: each Worker process (`vx.gpu.layers.vocab.ParallelLMHead.greedy_ids`).

Why: at one row a decode step only streams weights, so its time follows the bytes read, and
SmolLM2's LM head is a fifth of them (49,152 x 576 bf16, 57 MB). A greedy row needs only the
argmax of its logits. An int8 copy of the head (one
scale per vocab row) is half the bytes and gives every logit to within a bound; only the rows
whose bound reaches the best lower bound are computed again from the bf16 weight, by the very
kernel the logits path uses for that row count, on the same rows of x: `vx_gemm_panels_avx2`
(on the candidates' rows packed in its panels) beside `vx_screen_i8_avx2` where the head has
panels (AVX2 builds; they take its every row count), else `vx_gemv_bf16_avx2` beside it;
`vx_gemv_bf16` beside `vx_screen_i8` (AVX512-BF16,
`vx/gpu/cpu/csrc/screen.c`), `vx_gemm_amx_bf16` beside it where AMX is on, and on AVX512-BF16
without AMX `vx_gemm_vnni_bf16` (on the candidates' rows packed for it) where the head has a
VNNI copy, which takes its every row count. SmolLM2 on real text: a median of 6 candidate rows, at most 88.

Invariant: `ScreenedHead.argmax(x)` is the argmax (first maximum) of the bf16 logits that path
gives for every x; or None, and the caller forms the logits. Why:
- the copy stores, per row n, err[n] = max_k |s[n] q[n, k] - w[n, k]|, so
  |s[n] (x . q[n]) - x . w[n]| <= |x|_1 err[n];
- each fp32 dot product (the screen's and the bf16 kernel's) is within gamma |x|_1 (max|w[n]|
  + err[n]) of its exact value, gamma = 2 K 2^-24 (twice the textbook bound for K terms);
- so every logit the kernel gives lies in [a[n] - E[n], a[n] + E[n]], a the screen. With L the
  largest lower end, a row whose upper end is below L - |L| 2^-6 rounds to a bf16 value below
  the maximum's (bf16 spacing is at most 2^-7 of the value), so it cannot be or tie the
  argmax, and only the others (the candidates) are computed exactly.
The candidates' logits come from the same kernel with the same rows of x, so each is
bit-identical to the full product's (tested). Memory: the int8 copy, half the bf16 head.
`VX_CPU_SCREEN_HEAD=0` turns it off.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from vx import envs

__all__ = ["MAX_ROWS", "ScreenedHead", "screen_wanted"]

#: Rows up to which the screen is used: where the LM head only streams its weight.
MAX_ROWS = 1
#: Past this share of candidate rows, the screen gives up (None) and the logits path runs.
_MAX_CANDIDATE_SHARE = 1 / 16
_CHUNK = 4096  # rows quantized at a time, so the fp32 temporaries stay small


class ScreenKernels(NamedTuple):
    """One build's pair: `screen` the int8 kernel's name, `exact` the bf16 GEMM's, in `lib`."""

    lib: Any
    screen: str
    exact: str

    def gemv(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> int:
        """y [M, N] = x [M, K] @ w [N, K].T in bf16 by the exact kernel (its return code)."""
        m, (n, k) = x.shape[0], w.shape
        head = (x.data_ptr(), x.stride(0), m, w.data_ptr())
        if self.exact == "vx_gemv_bf16":  # it takes a scale before the bias
            return self.lib.vx_gemv_bf16(*head, None, None, y.data_ptr(), n, n, k)
        if self.exact == "vx_gemm_vnni_bf16":  # on the rows packed, 16 a block
            pad = -n % 16
            wp = torch.cat([w, w.new_zeros(pad, k)]) if pad else w.contiguous()
            packed = torch.empty((n + pad) // 16, k // 2, 16, dtype=torch.int32)
            if self.lib.vx_pack_vnni_bf16(wp.data_ptr(), n + pad, k, packed.data_ptr()) != 0:
                return -2
            yp = torch.empty(m, n + pad, dtype=torch.bfloat16) if pad else y
            if x.stride(0) % 2 or x.data_ptr() % 4:
                x = x.contiguous()
            rc = self.lib.vx_gemm_vnni_bf16(x.data_ptr(), x.stride(0), m, packed.data_ptr(),
                                            None, yp.data_ptr(), n + pad, n + pad, k)  # fmt: skip
            if pad:
                y.copy_(yp[:, :n])
            return rc
        if self.exact == "vx_gemm_panels_avx2":  # on the rows in its panels, 16 a block
            pad = -n % 16
            wp = torch.cat([w, w.new_zeros(pad, k)]) if pad else w
            # `vx.gpu.cpu.widen.pack_panels`' layout (a fresh tensor: 64-byte aligned)
            panels = wp.view((n + pad) // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
            yp = torch.empty(m, n + pad, dtype=torch.bfloat16) if pad else y
            rc = self.lib.vx_gemm_panels_avx2(x.data_ptr(), x.stride(0), m, panels.data_ptr(),
                                              None, yp.data_ptr(), n + pad, n + pad, k)  # fmt: skip
            if pad:
                y.copy_(yp[:, :n])
            return rc
        if self.exact == "vx_gemm_amx_bf16" and n % 16:  # it takes 16 rows a block
            pad = -n % 16
            wp = torch.cat([w, w.new_zeros(pad, k)])
            yp = torch.empty(m, n + pad, dtype=torch.bfloat16)
            rc = self.lib.vx_gemm_amx_bf16(x.data_ptr(), x.stride(0), m, wp.data_ptr(), None,
                                           yp.data_ptr(), n + pad, n + pad, k)  # fmt: skip
            y.copy_(yp[:, :n])
            return rc
        return getattr(self.lib, self.exact)(*head, None, y.data_ptr(), n, n, k)


def _kernels() -> ScreenKernels | None:
    """This build's pair, or None: the AVX2 one where the AVX2 skinny GEMM runs
    (`vx.gpu.cpu.widen`), else the AVX512-BF16 one where the AVX-512 skinny GEMM is built with
    VDPBF16PS (`vx.gpu.cpu.ops`)."""
    from vx.gpu.cpu.widen import _skinny_rows, _state

    if _skinny_rows():
        return ScreenKernels(_state["lib"], "vx_screen_i8_avx2", "vx_gemv_bf16_avx2")
    from vx.gpu.cpu.ops import gemv_kernels

    lib = gemv_kernels()
    if lib is not None and lib.vx_has_screen() == 1:
        # with AMX on, the logits path's GEMM at every row count is the AMX one (`ops`)
        exact = "vx_gemm_amx_bf16" if lib.vx_fast_amx(-1) else "vx_gemv_bf16"
        return ScreenKernels(lib, "vx_screen_i8", exact)
    return None


def screen_wanted(weight: torch.Tensor) -> bool:
    """Whether an LM head of this weight gets a screen here: bf16 on CPU where one of the
    kernel pairs of `_kernels` is built (its GEMM is the one the exact rows go through)."""
    return (
        envs.VX_CPU_SCREEN_HEAD
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] <= 16384
        and (kernels := _kernels()) is not None
        # the AVX2 kernels take K in 8s, the VDPBF16PS ones in 32s
        and weight.shape[1] % (8 if kernels.screen == "vx_screen_i8_avx2" else 32) == 0
    )


class ScreenedHead:
    """An int8 copy of a bf16 [N, K] LM head, with the per-row bounds of the search above."""

    def __init__(self, weight: torch.Tensor, vnni: bool = False, panels: bool = False) -> None:
        """vnni: the head's logits come from its VNNI copy at every row count (AVX512-BF16
        without AMX, `vx.gpu.cpu.vnni`), so the candidates' do too (`vx_gemm_vnni_bf16`).
        panels: the same on AVX2 builds, from the panel GEMM (`vx_gemm_panels_avx2`: the head's
        `WideWeight` has panels and no compact copy, so they take its every row count)."""
        w = weight.detach()
        n, k = w.shape
        self.weight = w
        self.q = torch.empty(n, k, dtype=torch.int8)
        self.s = torch.empty(n, dtype=torch.float32)
        err = torch.empty(n, dtype=torch.float64)
        wmax = torch.empty(n, dtype=torch.float64)
        for i in range(0, n, _CHUNK):
            wf = w[i : i + _CHUNK].float()
            amax = wf.abs().amax(1)
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            q = torch.round(wf / scale[:, None]).clamp_(-127, 127)
            err[i : i + _CHUNK] = (wf - q * scale[:, None]).abs().amax(1).double()
            wmax[i : i + _CHUNK] = amax.double()
            self.q[i : i + _CHUNK] = q.to(torch.int8)
            self.s[i : i + _CHUNK] = scale
        gamma = 2 * k * 2.0**-24
        # E[n] = |x|_1 * bound[n]; the last factor covers this product's own rounding.
        self.bound = ((err + gamma * (2 * wmax + err)) * (1 + 1e-6)).numpy()
        self._bound_ptr = self.bound.ctypes.data
        self._kernels = _kernels()  # the build's pair, looked up once
        if vnni and self._kernels is not None and self._kernels.exact == "vx_gemv_bf16":
            self._kernels = self._kernels._replace(exact="vx_gemm_vnni_bf16")
        if panels and self._kernels is not None and self._kernels.exact == "vx_gemv_bf16_avx2":
            if k % 2 == 0:
                self._kernels = self._kernels._replace(exact="vx_gemm_panels_avx2")
        self._bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def argmax(self, x: torch.Tensor) -> np.ndarray | None:
        """[M, K] bf16 -> [M] int64 (see the module docstring); None: not taken here."""
        kernels = self._kernels
        m = x.shape[0]
        n, k = self.weight.shape
        if kernels is None or not 0 < m <= MAX_ROWS:
            return None
        if x.dtype != torch.bfloat16 or x.stride(1) != 1:
            return None
        a, union, cand = self._scratch(m)
        rc = getattr(kernels.lib, kernels.screen)(
            x.data_ptr(), x.stride(0), m, self.q.data_ptr(), self.s.data_ptr(), a.data_ptr(), n, k
        )
        if rc != 0:
            return None
        cap = union.shape[0]
        u = kernels.lib.vx_screen_select(
            a.data_ptr(), m, n, self._bound_ptr, x.data_ptr(), x.stride(0), k,
            union.data_ptr(), cand.data_ptr(), cap,
        )  # fmt: skip
        if u < 0:  # too many candidates, or x not finite
            return None
        union, cand = union[:u], cand[:, :u]
        y = torch.empty(m, u, dtype=torch.bfloat16)
        if kernels.gemv(x, self.weight.index_select(0, union), y) != 0:
            return None
        # Non-candidates of a row are -inf there, so its first maximum is a candidate's.
        best = np.where(cand.numpy().astype(bool), y.float().numpy(), -np.inf)
        return union.numpy()[np.argmax(best, axis=1)]

    def exact_kernel(self) -> str | None:
        """The name of the bf16 GEMM the candidates' logits come from (None: no kernels)."""
        return None if self._kernels is None else self._kernels.exact

    def row_scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row's scratch, as `argmax` uses it: allocated once for `MAX_ROWS` rows and
        never replaced after (C callers keep pointers to it)."""
        return self._scratch(MAX_ROWS)

    def _scratch(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The screen's [m, N] fp32 out, the candidates' union and their [m, cap] row flags:
        kept between steps (a fresh 196 KB array is fresh pages each step)."""
        if self._bufs is None or self._bufs[0].shape[0] < m:
            n = self.weight.shape[0]
            cap = max(1, int(n * _MAX_CANDIDATE_SHARE))
            rows = max(m, MAX_ROWS)
            self._bufs = (
                torch.empty(rows, n, dtype=torch.float32),
                torch.empty(cap, dtype=torch.int64),
                torch.empty(rows, cap, dtype=torch.uint8),
            )
        a, union, cand = self._bufs
        return a[:m], union, cand[:m]
