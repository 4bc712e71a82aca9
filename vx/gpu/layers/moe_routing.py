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

__all__ = ["group_by_expert", "select_experts"]


def select_experts(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weights_in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k], expert ids [T, k] int64), HF's arithmetic."""
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
