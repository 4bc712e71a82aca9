"""OLMoE: the Llama decoder with q/k RMSNorms over the whole projection, over sparse experts.

Runs in: each Worker process.

OLMoE-1B-7B's differences from the Llama block (HF's `OlmoeAttention` and
`OlmoeSparseMoeBlock`):
- `q_norm` normalises all of q's heads together (a weight of num_heads x head_dim) and `k_norm`
  all of k's, after the projection and before the rotary. Under tensor parallelism a rank holds
  some heads only, so the norm gathers q and k across the ranks, normalises, and keeps its own
  slice (as vLLM's OLMoE does);
- `clip_qkv`, where set, clamps q, k and v after the norms (HF's order);
- a softmax router with top-k, renormalised only where `norm_topk_prob` (off in the released
  configs), the weights cast to the model dtype: Qwen3-MoE's router (`MoEArgs`), with every
  layer sparse and the experts `intermediate_size` wide.

Checkpoint names are Qwen3-MoE's: `mlp.gate` and `mlp.experts.{e}.gate_proj/up_proj/down_proj`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from vx.gpu.layers.linear import RMSNorm, _all_gather_last_dim, apply_rotary
from vx.gpu.models.llama import LlamaAttention, ModelArgs, Rope
from vx.gpu.models.mixtral import MoEArgs
from vx.gpu.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["OlmoeAttention", "OlmoeForCausalLM"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OlmoeArgs(MoEArgs):
    """MoEArgs plus `clip_qkv` (None: no clamp)."""

    clip_qkv: float | None = None

    @classmethod
    def from_hf(cls, cfg: Any) -> OlmoeArgs:
        base = MoEArgs.from_hf(cfg)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(MoEArgs)}
        return cls(**fields, clip_qkv=getattr(cfg, "clip_qkv", None))


class OlmoeAttention(LlamaAttention):
    """Llama attention with RMSNorms over q's and k's whole width (weights [Hq * D], [Hkv * D])."""

    def __init__(self, a: ModelArgs, attn_fn: Any, **kw: Any) -> None:
        super().__init__(a, attn_fn, **kw)
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        self.tp_rank, self.tp_size = kw.get("tp_rank", 0), kw.get("tp_size", 1)
        if self.tp_size > 1 and a.num_kv_heads % self.tp_size:
            raise NotImplementedError(
                f"OLMoE's k_norm spans every kv head: {a.num_kv_heads} kv heads cannot split "
                f"over tensor_parallel_size {self.tp_size}"
            )
        self.q_norm = RMSNorm(a.num_heads * a.head_dim, a.rms_norm_eps, **dd)
        self.k_norm = RMSNorm(a.num_kv_heads * a.head_dim, a.rms_norm_eps, **dd)
        self.clip_qkv = a.clip_qkv if isinstance(a, OlmoeArgs) else None

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """`norm` over the full width of `x` [T, local width]: this rank's slice of it."""
        if self.tp_size == 1:
            return norm(x)
        full = norm(_all_gather_last_dim(x, self.tp_size))
        width = x.shape[-1]
        return full[:, self.tp_rank * width : (self.tp_rank + 1) * width]

    def project(self, rope: Rope, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = self._norm(self.q_norm, qkv[:, :q_end].contiguous())
        k = self._norm(self.k_norm, qkv[:, q_end:k_end].contiguous())
        v = qkv[:, k_end:]
        if self.clip_qkv is not None:  # after the norms, as HF's (vLLM's clamps before them)
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = q.reshape(t, -1, d), k.reshape(t, -1, d)
        qk = apply_rotary(torch.cat((q, k), dim=1), *rope)
        v = v.reshape(t, self.num_kv_heads, d)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    """OLMoE-1B-7B (64 experts, top-8) and its smaller random-weight kin."""

    args_cls = OlmoeArgs

    def attention(self, a: ModelArgs, **kw: Any) -> nn.Module:
        return OlmoeAttention(a, self.attn_fn, **kw)
