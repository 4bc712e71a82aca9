"""Phi-3 and Phi-4-mini: the Llama decoder with fused checkpoints, partial rotary, LongRoPE.

Runs in: each Worker process.

What differs from Llama:
- the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`;
  `load_weights` cuts them into HF's separate tensors first, so tensor parallelism shards
  each part as for Llama;
- Phi-4-mini rotates only the first `partial_rotary_factor` of each head (0.75) and passes
  the rest through (`Phi3Attention.project`);
- LongRoPE ("longrope", Phi-3-*-128k, Phi-4-mini): short factors below the original context,
  long ones from it on, cos/sin scaled by the attention factor: all in the rotary table
  (`vx.gpu.layers.rotary.RotaryEmbedding`), which needs `original_max_position_embeddings`
  and `max_position_embeddings` in the rope dict (`Phi3Args`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vx.gpu.layers.linear import apply_rotary
from vx.gpu.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, ModelArgs, Rope

__all__ = ["Phi3ForCausalLM"]


class Phi3Args(ModelArgs):
    """ModelArgs, with the context lengths LongRoPE reads put in the rope dict."""

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelArgs:
        base = ModelArgs.from_hf(cfg)
        rope = dict(base.rope)
        if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
            rope["rope_type"] = "longrope"
            rope.setdefault(
                "original_max_position_embeddings", cfg.original_max_position_embeddings
            )
            rope.setdefault("max_position_embeddings", cfg.max_position_embeddings)
        return dataclasses.replace(base, rope=rope)


class Phi3Attention(LlamaAttention):
    """Llama attention whose rotary may turn only the first `rotary_dim` dims of a head."""

    def project(self, rope: Rope, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.rotary_dim == self.head_dim:
            return super().project(rope, x)
        t, d, r = x.shape[0], self.head_dim, self.rotary_dim
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(t, -1, d)  # [T, Hq+Hkv, D]: q and k turned in one pass
        qk = torch.cat((apply_rotary(qk[..., :r].contiguous(), *rope), qk[..., r:]), dim=-1)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, d)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (mini/small/medium, 4k and 128k), Phi-3.5-mini, Phi-4-mini."""

    args_cls = Phi3Args

    def build_blocks(self, a: ModelArgs, layer: int, **kw: Any) -> tuple[nn.Module, nn.Module]:
        return Phi3Attention(a, self.attn_fn, **kw), LlamaMLP(a, **kw)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF's separate q/k/v and gate/up tensors out of Phi-3's fused ones."""
        a = self.args
        qkv = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split(qkv), strict=True):
                    yield name.replace("qkv_proj", part), t
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor
