"""The experts of a mixture-of-experts layer on CPU: each expert's linears on the dense kernels.

Runs in: each Worker process (CPU devices).

Why: the torch experts (`vx.gpu.layers.fused_moe.moe_reference`) multiply each expert's rows
with `F.linear`, which on a CPU runs torch's bf16 GEMM on the plain weight, while a dense
layer's linears take vx's skinny GEMM, its AMX / VNNI GEMMs over packed copies, the fp32
panels of a CPU without bf16 arithmetic, or a weight-only int8 / int4 copy. Here each expert's
gate-up and down are two linears of their own, whose method chains `select_linear_method`
chooses once at load exactly as for a dense layer's (a gate-up's AMX copy is the GEMM with the
SiLU-mul in its epilogue), so an expert's rows take the kernel a dense layer's rows of that
count would. The difference: no oneDNN copy (the chain ends in `F.linear` on the stacked
weight, which stays for the torch path and tensor parallelism; an expert's rows are a step's
rows times top-k over E, rarely past the AMX GEMM's 2,048).

`CpuExperts` keeps `moe_reference`'s contract and its grouping: the (token, slot) pairs are
sorted by expert and their rows gathered once, each expert the step touches runs its two
linears on its contiguous run of rows, and the weighted outputs are scattered back once and
each token's k slots summed; experts no token picked cost nothing. In bf16 the grouping and
the weighted sum are one C call each (`vx/gpu/cpu/csrc/moe.c`: the counts land in host memory,
no torch op reads them back); they were ~15 torch ops a layer, a tenth of a 32-row decode step
of a 1 B MoE (measured). fp32 (and a host without the kernel library) keeps those torch ops,
`_torch_glue`, the same arithmetic. NOTE: not `index_add_` per expert as the torch experts: on
bf16 CPU tensors it took most of the layer's time (measured, 64 rows, SmolLM2 widths), and so
did `sum` over the slots. The slots are added in slot order, the torch experts' adds in expert
order: the same bits for k = 2 (0 + a, then a + b), maybe not in the last bit for k > 2.

On AMX, where every expert has the AMX copies (no quantization), the experts' GEMMs are one C
call a layer (`vx_moe_experts_amx`, `vx/gpu/cpu/csrc/experts_amx.c`) instead of two calls per
touched expert: the work items of every touched expert in one list that both threads take
from, the bits of each expert's own AMX GEMMs (the SiLU gate-up, then the down) at every row
count (so at 1-7 rows, where the chains take the skinny GEMMs, the sums' order is the AMX
GEMM's). One layer of `bench/forward.py`'s MoE shapes (hidden 576, experts 768, 8 x top-2),
minimum of 15 calls, against the chains: 16 tokens 0.50 against 0.74 ms, 128 tokens 0.69
against 0.97; the 1 B model's (1,536, 1,024): 16 tokens 1.35 against 1.90, 1,024 tokens 11.8
against 14.2 (2-core Sapphire Rapids, exclusive lock). The fused CPU step calls the same
kernel (`vx.gpu.cpu.fused_step`).

On AVX512-BF16 without AMX (Zen 4 and 5), where every expert has VNNI copies, the same holds
with `vx_moe_experts_vnni` (`vx/gpu/cpu/csrc/experts_vnni.c`): each expert's gate-up, the
SiLU-mul and its down in one parallel region, the bits of its own VNNI GEMMs and
`vx_silu_and_mul_bf16` at every row count (the chains take those copies from one row there,
so the two agree); the fused CPU step calls it too (docs/performance.md has the figures).

Invariants: expert e's linears read `w13[e]` / `w2[e]`, views of the stacked parameters (no
copy of the plain weight); the copies a chain keeps are made once, in `CpuExperts.__init__`.
"""

from __future__ import annotations

import numpy as np
import torch

from vx.gpu.cpu.ops import eltwise_kernels
from vx.gpu.cpu.vnni import amx_vnni_rows
from vx.gpu.layers.linear import silu_and_mul
from vx.gpu.layers.linear_method import WeightForms, select_linear_method
from vx.gpu.layers.moe_routing import group_by_expert

__all__ = ["CpuExperts", "ExpertLinear"]


class ExpertLinear(WeightForms):
    """One expert's gate-up ([gate; up], `silu_pairs`) or down, bias-free: `weight` a view of
    the stacked weight, `method` its chain (no oneDNN copy)."""

    def __init__(self, weight: torch.Tensor, quantization: str | None, *, silu_pairs: bool) -> None:
        self.weight = weight
        self.bias = None
        self.quantization = quantization
        self.silu_pairs = silu_pairs
        self.method, _ = select_linear_method(self, onednn=False)
        v = self.vnni  # asked once: `vnni` walks the chain
        #: the AMX copy with the SiLU-mul epilogue (a gate-up's, on AMX), else None
        self.silu_vnni = v if v is not None and v.silu else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, None)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x [n, H] -> [n, I]: the AMX GEMM with its SiLU epilogue where its
        copy takes x's rows (as `MergedColumnParallelLinear.silu_and_mul`), else the GEMM then
        the SiLU-mul."""
        v = self.silu_vnni
        if v is not None and x.dtype == torch.bfloat16 and x.shape[0] >= amx_vnni_rows()[0]:
            out = v.apply_silu(x)
            if out is not None:
                return out
        return silu_and_mul(self(x))


#: Rows past the routed ones that the grouped rows' buffers keep readable: the AMX experts'
#: GEMM (`vx_moe_experts_amx`) reads whole 32-row blocks (the rows past an expert's are never
#: stored).
SLACK_ROWS = 32


def _pointers(ups: list, downs: list) -> tuple[np.ndarray, np.ndarray]:
    """The experts' packed gate-up and down copies as C pointer arrays (uint64)."""
    return (
        np.array([v.packed.data_ptr() for v in ups], dtype=np.uint64),
        np.array([v.packed.data_ptr() for v in downs], dtype=np.uint64),
    )


class CpuExperts:
    """The experts' compute for `FusedMoE.experts_fn` on CPU: `moe_reference`'s contract
    (x [T, H]; weights, ids [T, k]) -> [T, H] in x's dtype, over each expert's own chains.

    On AMX, where every expert has the AMX copies (a gate-up's with the SiLU epilogue, a
    down's), all the touched experts' GEMMs are one C call (`vx/gpu/cpu/csrc/experts_amx.c`,
    `grouped`): the bits of those copies' GEMMs on each expert's rows, for every row count.
    Without AMX, where every expert has VNNI copies, likewise (`experts_vnni.c`,
    `grouped_vnni`)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, quantization: str | None) -> None:
        self.gate_up = [ExpertLinear(w, quantization, silu_pairs=True) for w in w13.data]
        self.down = [ExpertLinear(w, quantization, silu_pairs=False) for w in w2.data]
        self.hidden, self.inter = w2.shape[1], w2.shape[2]
        #: (each expert's SiLU gate-up copy, its down copy) as C pointer arrays, where the AMX
        #: experts' GEMM takes this layer, else None
        self.grouped: tuple[np.ndarray, np.ndarray] | None = None
        ups = [e.silu_vnni for e in self.gate_up]
        downs = [e.vnni for e in self.down]
        lib = eltwise_kernels()
        if (
            lib is not None
            and lib.vx_has_gemm_amx_vnni()
            and all(v is not None for v in ups)
            and all(v is not None and v.amx and not v.silu for v in downs)
            # fp32 copies first in the chains (`VX_CPU_WIDEN=1` on an AMX host: A/B, tests)
            and all(e.wide is None for e in (*self.gate_up, *self.down))
            and self.hidden % 32 == 0
            and self.inter % 32 == 0
            and len(ups) <= 256
        ):
            self.grouped = _pointers(ups, downs)
        #: (each expert's gate-up VNNI copy, its down's) as C pointer arrays, where the VNNI
        #: experts' GEMM takes this layer (AVX512-BF16 without AMX), else None
        self.grouped_vnni: tuple[np.ndarray, np.ndarray] | None = None
        ups = [e.vnni for e in self.gate_up]
        downs = [e.vnni for e in self.down]
        if (
            self.grouped is None
            and lib is not None
            and lib.vx_has_gemm_vnni()
            and all(v is not None and not v.amx and not v.silu for v in (*ups, *downs))
            and all(e.wide is None for e in (*self.gate_up, *self.down))
            and self.hidden % 16 == 0
            and self.inter % 16 == 0
            and len(ups) <= 256
        ):
            self.grouped_vnni = _pointers(ups, downs)

    def __repr__(self) -> str:
        return (
            f"CpuExperts({len(self.gate_up)} x [{self.gate_up[0].method}; {self.down[0].method}])"
        )

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        t, k = ids.shape
        if t == 0:
            return torch.zeros_like(x)
        lib = eltwise_kernels()
        if (
            lib is None
            or x.dtype != torch.bfloat16
            or x.dim() != 2
            or x.stride(-1) != 1
            or weights.dtype not in (torch.float32, torch.bfloat16)
        ):
            return self._torch_glue(x, weights, ids)
        n, h = t * k, x.shape[1]
        ids = ids.contiguous().to(torch.int64)
        counts = np.empty(len(self.gate_up), dtype=np.int64)
        pos = torch.empty(n, dtype=torch.int64)
        xs = torch.empty(n + SLACK_ROWS, h, dtype=torch.bfloat16)
        rc = lib.vx_moe_group_bf16(
            x.data_ptr(), x.stride(0), ids.data_ptr(), t, k, len(counts), h,
            counts.ctypes.data, pos.data_ptr(), xs.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"expert ids out of range [0, {len(counts)})")
        ys = self._run_experts(xs, counts.tolist())
        weights = weights.contiguous()
        out = torch.empty(t, h, dtype=torch.bfloat16)
        lib.vx_moe_combine_bf16(
            ys.data_ptr(), pos.data_ptr(), weights.data_ptr(),
            int(weights.dtype == torch.float32), t, k, h, out.data_ptr(),
        )  # fmt: skip
        return out

    def _run_experts(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each touched expert's two linears on its contiguous run of the grouped rows xs
        (`SLACK_ROWS` rows past them, for the AMX experts' GEMM): [sum(counts), H]."""
        n = sum(counts)
        ys = xs.new_empty(n, xs.shape[1])
        if self.grouped is not None and xs.dtype == torch.bfloat16 and xs.is_contiguous():
            if xs.shape[0] < n + SLACK_ROWS:
                raise ValueError(f"the grouped rows need {SLACK_ROWS} rows of slack")
            act = torch.empty(n + SLACK_ROWS, self.inter, dtype=torch.bfloat16)
            c = np.ascontiguousarray(counts, dtype=np.int64)
            rc = eltwise_kernels().vx_moe_experts_amx(  # type: ignore[union-attr]
                xs.data_ptr(), c.ctypes.data, len(counts), self.grouped[0].ctypes.data,
                self.grouped[1].ctypes.data, self.hidden, self.inter, act.data_ptr(),
                ys.data_ptr(),
            )  # fmt: skip
            if rc == 0:
                return ys
            # -2: AMX switched off since loading (A/B timing, tests): the chains below
        if self.grouped_vnni is not None and xs.dtype == torch.bfloat16 and xs.is_contiguous():
            gu = torch.empty(n, 2 * self.inter, dtype=torch.bfloat16)
            act = torch.empty(n, self.inter, dtype=torch.bfloat16)
            c = np.ascontiguousarray(counts, dtype=np.int64)
            rc = eltwise_kernels().vx_moe_experts_vnni(  # type: ignore[union-attr]
                xs.data_ptr(), c.ctypes.data, len(counts), self.grouped_vnni[0].ctypes.data,
                self.grouped_vnni[1].ctypes.data, self.hidden, self.inter, gu.data_ptr(),
                act.data_ptr(), ys.data_ptr(),
            )  # fmt: skip
            if rc == 0:
                return ys
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                ys[rows] = self.down[e](self.gate_up[e].silu_and_mul(xs[rows]))
                start += n
        return ys

    def _torch_glue(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The glue in torch ops (fp32, or no kernel library): the same grouping and sums."""
        t, k = ids.shape
        order, counts = group_by_expert(ids, len(self.gate_up))
        xs = x.new_empty(t * k + SLACK_ROWS, x.shape[1])
        torch.index_select(x, 0, order // k, out=xs[: t * k])  # each pair's token row
        ys = self._run_experts(xs, counts)
        # weighted as the torch experts weigh (fp32 where the weights are), rounded to x's
        # dtype, then each token's k slots summed: one scatter, not one per expert
        flat_weights = weights.reshape(-1)[order, None]
        per_pair = torch.empty_like(ys)
        per_pair[order] = (ys * flat_weights).to(x.dtype)
        slots = per_pair.view(t, k, -1)
        out = slots[:, 0].clone()
        for j in range(1, k):
            out += slots[:, j]
        return out
