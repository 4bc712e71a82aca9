"""Mixture-of-experts routing: the router's top-k and the grouping of routed rows by expert.

Runs in: each Worker process.

`select_experts` is the router after its logits: softmax in fp32, top-k, optional
renormalisation of the k weights to sum to 1 (Mixtral always; Qwen3-MoE by `norm_topk_prob`),
then the weights in fp32 (Mixtral) or cast to the logits' dtype (Qwen3-MoE), as each HF family.

`group_by_expert` is the preamble every grouped experts' implementation shares (the torch
experts, the CPU experts' torch glue): the (token, slot) pairs sorted by expert, stably, and
the pairs per expert. NOTE: it reads the counts back to the host (one sync per MoE layer).
"""

from __future__ import annotations

import torch

from vx.gpu.cpu.ops import eltwise_kernels

__all__ = ["group_by_expert", "select_experts"]


def select_experts(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weights_in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k], expert ids [T, k] int64), HF's arithmetic.

    CPU bf16 logits take one C call (`vx_moe_topk_bf16`) for the five torch ops: the same
    arithmetic up to the last bit of the fp32 softmax (its exp and sum are not torch's)."""
    fused = _cpu_topk(router_logits, top_k, renormalize, weights_in_fp32)
    if fused is not None:
        return fused
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_in_fp32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids [T, k] -> (order [T * k]: the pairs t * k + slot grouped by expert, in pair order
    within an expert; counts: the pairs of each of the `num_experts` experts, on the host)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host read
    return order, counts


def _cpu_topk(
    logits: torch.Tensor, k: int, renormalize: bool, weights_in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`select_experts` in C for CPU bf16 logits [T, E] with unit column stride, else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.bfloat16 or logits.dim() != 2:
        return None
    lib = eltwise_kernels()
    if lib is None or logits.stride(1) != 1 or not 0 < k <= logits.shape[1]:
        return None
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=torch.float32 if weights_in_fp32 else torch.bfloat16)
    ids = torch.empty(t, k, dtype=torch.int64)
    lib.vx_moe_topk_bf16(
        logits.data_ptr(), logits.stride(0), t, e, k, int(renormalize), int(weights_in_fp32),
        weights.data_ptr(), ids.data_ptr(),
    )  # fmt: skip
    return weights, ids
