"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before the rotary.

Runs in: each Worker process.

Qwen3 has no q/k/v bias (`attention_bias` is false in every released config); its one change
to the Llama block is `q_norm`/`k_norm`, RMSNorms over `head_dim` applied per head to q and
k after the projection and before the rotary, as HF's `Qwen3Attention`. Only `project`
differs from `LlamaAttention`: the fused qkv GEMM, the paged attention and the o_proj are the
Llama ones. The fused CPU step (`vx.gpu.cpu.fused_step`) runs this block too (the q/k norms
in its C code, with the module path's kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vx.gpu.layers.linear import RMSNorm, apply_rotary
from vx.gpu.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, ModelArgs, Rope

__all__ = ["Qwen3Attention", "Qwen3ForCausalLM"]


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head q/k RMSNorm (weights [head_dim], shared by the heads)."""

    def __init__(self, a: ModelArgs, attn_fn: Any, **kw: Any) -> None:
        super().__init__(a, attn_fn, **kw)
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, **dd)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, **dd)

    def project(self, rope: Rope, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        k_end = self.q_size + self.kv_size
        # Each head is normalised over D in place in the GEMM's output, q and k rotated in
        # place together (as in LlamaAttention): no copies of the heads.
        qk = qkv[:, :k_end].view(t, -1, d)
        self.q_norm.norm_heads_(qk[:, : self.num_heads])
        self.k_norm.norm_heads_(qk[:, self.num_heads :])
        qk = apply_rotary(qk, *rope)
        v = qkv[:, k_end:].view(t, self.num_kv_heads, d)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (0.6B ... 32B)."""

    def build_blocks(self, a: ModelArgs, layer: int, **kw: Any) -> tuple[nn.Module, nn.Module]:
        return Qwen3Attention(a, self.attn_fn, **kw), LlamaMLP(a, **kw)
