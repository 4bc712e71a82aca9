"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) over Mixtral-style sparse experts.

Runs in: each Worker process.

The router renormalises its top-k weights only where the config says `norm_topk_prob`, and
casts them to the model dtype before weighing the experts (HF's `Qwen3MoeTopKRouter`); layers
listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, have a dense MLP of
`intermediate_size` (`MoEArgs.sparse_layers`). Checkpoint names: `mlp.gate` (the router) and
`mlp.experts.{e}.gate_proj/up_proj/down_proj`.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vx.gpu.models.llama import ModelArgs
from vx.gpu.models.mixtral import MoEForCausalLM
from vx.gpu.models.qwen3 import Qwen3Attention

__all__ = ["Qwen3MoeForCausalLM"]


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B and their smaller random-weight kin."""

    _EXPERT = re.compile(
        r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
    )
    _PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def attention(self, a: ModelArgs, **kw: Any) -> nn.Module:
        return Qwen3Attention(a, self.attn_fn, **kw)
