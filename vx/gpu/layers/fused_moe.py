"""Mixture-of-experts: top-k routing and the experts' SwiGLU MLPs, stacked in one module.

Runs in: each Worker process.

`FusedMoE` holds every expert's weights stacked, as vLLM's `FusedMoE` does: `w13` [E, 2 I, H]
(each expert's gate rows then its up rows) and `w2` [E, H, I]. Under tensor parallelism each
rank holds a slice of every expert (I / tp rows of gate and of up, the matching columns of
down) and the partial outputs are all-reduced, as a RowParallelLinear's are; expert
parallelism (whole experts per rank) is not done.

The router's top-k (`select_experts`) and the grouping of the routed rows by expert
(`group_by_expert`) are `vx.gpu.layers.moe_routing`'s.

`moe_reference` is the torch implementation, grouped per expert: the (token, slot) pairs are
sorted by expert and each expert that the step touches runs one GEMM pair over its tokens, so
the cost follows the routed tokens, not T x E. Experts are visited in ascending order and their
weighted outputs added with `index_add_`, HF's order, so fp32 results match HF's closely.
NOTE: it reads the per-expert counts back to the host (one sync per MoE layer); a model with
these layers is not CUDA-graph capturable (`LlamaForCausalLM.graph_capturable`). On CUDA
`FusedMoE` takes the Triton kernel instead (`vx.gpu.layers.moe_kernel`, same contract), which
reads nothing back; graphs stay off for MoE models until they are checked on a GPU. On CPU,
after loading, it takes `vx.gpu.layers.cpu_experts.CpuExperts` (same contract and grouping):
each expert's linears on the dense layers' kernels, and the weight-only int8 / int4 copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vx.gpu.layers.cpu_experts import CpuExperts
from vx.gpu.layers.linear import _all_reduce, _divide, silu_and_mul
from vx.gpu.layers.moe_routing import group_by_expert, select_experts

__all__ = ["FusedMoE", "moe_reference", "select_experts"]


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert[ids[t, k]](x[t]), [T, H] in x's dtype.

    x [T, H]; w13 [E, 2 I, H]; w2 [E, H, I]; weights, ids [T, k]. Correct for any T (0 too) and
    any routing, repeated experts across tokens included; a token never names one expert twice
    (top-k ids are distinct).
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    k = ids.shape[1]
    order, counts = group_by_expert(ids, w13.shape[0])  # (token, slot) pairs by expert
    flat_weights = weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        h = silu_and_mul(F.linear(x[tokens], w13[e]))  # [n, I]
        h = F.linear(h, w2[e]) * flat_weights[pairs, None]  # [n, H], fp32 if weights are
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """E SwiGLU experts with top-k routing; `forward(x, router_logits)` -> [T, H].

    Invariants: `w13` is [E, 2 I_r, H] with gate rows [0, I_r) and up rows [I_r, 2 I_r) of
    each expert, `w2` is [E, H, I_r], I_r = I / tp_size (this rank's slice); every expert's
    three tensors are filled by `weight_loader` (the model checks none is missing).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        weights_in_fp32: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.quantization = quantization  # weight-only, each expert's copies made after loading
        self.renormalize, self.weights_in_fp32 = renormalize, weights_in_fp32
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.inter = _divide(intermediate_size, tp_size, "expert intermediate size")
        e, i, h = num_experts, self.inter, hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device), False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device), False)
        #: the experts' compute, chosen once: the Triton kernel on CUDA where triton is there
        #: (`vx.gpu.layers.moe_kernel`), on CPU each expert's linear chains after loading
        #: (`process_weights_after_loading`), else the torch reference
        self.experts_fn: Callable[..., torch.Tensor] = moe_reference
        if quantization and torch.device(device).type != "cpu":
            raise NotImplementedError("weight-only quantization of experts is CPU-only")
        if torch.device(device).type == "cuda":
            from vx.gpu.layers import moe_kernel

            if moe_kernel.HAS_TRITON:
                self.experts_fn = moe_kernel.fused_experts

    def weight_loader(self, loaded: torch.Tensor, expert: int, part: str) -> None:
        """Copy this rank's slice of one HF expert tensor: `part` is "gate", "up" (rows of
        w13) or "down" (columns of w2); `loaded` is the full [I, H] or [H, I] tensor."""
        i, lo = self.inter, self.tp_rank * self.inter
        if part == "down":
            self.w2.data[expert].copy_(loaded.narrow(1, lo, i))
        else:
            at = 0 if part == "gate" else i
            self.w13.data[expert, at : at + i].copy_(loaded.narrow(0, lo, i))

    def process_weights_after_loading(self) -> None:
        """Called once by the loader after every expert is in place: on CPU, each expert's
        linears get their kernels' copies (`CpuExperts`)."""
        if self.w13.device.type == "cpu":
            self.experts_fn = CpuExperts(self.w13, self.w2, self.quantization)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            router_logits,
            self.top_k,
            renormalize=self.renormalize,
            weights_in_fp32=self.weights_in_fp32,
        )
        out = self.experts_fn(x, self.w13, self.w2, weights, ids)
        return out if self.tp_size == 1 else _all_reduce(out)
