"""Mixtral: the Llama decoder with a sparse mixture of SwiGLU experts in place of the MLP.

Runs in: each Worker process.

Each layer's MLP is a `SparseMoeBlock`: a router (a replicated linear, hidden -> E logits) and
`vx.gpu.layers.fused_moe.FusedMoE` (softmax, top-k, the k weights renormalised to sum to 1,
kept in fp32 as HF's `MixtralTopKRouter`). Attention, norms, rotary, LM head and the loading
of everything else are the Llama family's. `MoEArgs` and `SparseMoeBlock` serve Qwen3-MoE too
(models/qwen3_moe.py), which differs in names, its q/k norms and optional renormalisation.

Checkpoint names (HF and Mistral's): `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down); the module is `mlp`, as every family's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from vx.gpu.layers.fused_moe import FusedMoE
from vx.gpu.layers.linear import ColumnParallelLinear
from vx.gpu.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, ModelArgs

__all__ = ["MixtralForCausalLM", "MoEArgs", "MoEForCausalLM", "SparseMoeBlock"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEArgs(ModelArgs):
    """ModelArgs plus the experts: which layers have them and how the router weighs them."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool
    weights_in_fp32: bool
    #: per layer: True where the MLP is the experts, False where it is a dense LlamaMLP
    sparse_layers: tuple[bool, ...]

    @classmethod
    def from_hf(cls, cfg: Any) -> MoEArgs:
        base = ModelArgs.from_hf(cfg)
        arch = (getattr(cfg, "architectures", None) or [""])[0]
        num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        if arch.startswith("Mixtral"):
            inter, renorm, fp32, sparse = cfg.intermediate_size, True, True, None
        else:  # Qwen3-MoE: decoder_sparse_step and mlp_only_layers pick the sparse layers;
            # OLMoE: every layer sparse, its experts `intermediate_size` wide
            step = getattr(cfg, "decoder_sparse_step", 1)
            dense = set(getattr(cfg, "mlp_only_layers", None) or ())
            sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(base.num_layers))
            inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
            renorm, fp32 = bool(cfg.norm_topk_prob), False
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelArgs)},
            num_experts=num_experts,
            top_k=cfg.num_experts_per_tok,
            moe_intermediate_size=inter,
            renormalize=renorm,
            weights_in_fp32=fp32,
            sparse_layers=sparse or (True,) * base.num_layers,
        )


class SparseMoeBlock(nn.Module):
    """The router and the experts: [T, hidden] -> [T, hidden]."""

    def __init__(self, a: MoEArgs, **kw: Any) -> None:
        super().__init__()
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        # Replicated (every rank routes every token): tp_size 1 whatever the model's; the router
        # stays unquantized (E outputs), the experts take weight-only quantization.
        self.gate = ColumnParallelLinear(a.hidden_size, [a.num_experts], bias=False, **dd)
        self.experts = FusedMoE(
            a.num_experts,
            a.top_k,
            a.hidden_size,
            a.moe_intermediate_size,
            renormalize=a.renormalize,
            weights_in_fp32=a.weights_in_fp32,
            tp_rank=kw["tp_rank"],
            tp_size=kw["tp_size"],
            quantization=kw.get("quantization"),
            **dd,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama decoder whose MLPs are (some of them) `SparseMoeBlock`s.

    Subclasses set `_EXPERT` (a regex over HF names with groups layer prefix, expert, HF part)
    and `_PARTS` (HF part -> "gate" / "up" / "down"); `_RENAMES` maps other HF name pieces to
    the module's (Mixtral's `block_sparse_moe.` -> `mlp.`).
    """

    args_cls = MoEArgs
    graph_capturable = False  # the torch experts read their token counts back (fused_moe)
    _EXPERT: re.Pattern[str]
    _PARTS: dict[str, str]
    _RENAMES: dict[str, str] = {}

    def attention(self, a: ModelArgs, **kw: Any) -> nn.Module:
        """A layer's attention: Llama's here; Qwen3-MoE's has q/k norms."""
        return LlamaAttention(a, self.attn_fn, **kw)

    def build_blocks(self, a: ModelArgs, layer: int, **kw: Any) -> tuple[nn.Module, nn.Module]:
        assert isinstance(a, MoEArgs)
        mlp = SparseMoeBlock(a, **kw) if a.sparse_layers[layer] else LlamaMLP(a, **kw)
        return self.attention(a, **kw), mlp

    def load_family_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        m = self._EXPERT.fullmatch(name)
        if m is None:
            for hf, ours in self._RENAMES.items():
                if hf in name:
                    name = name.replace(hf, ours)
                    param = params.get(name)
                    if param is None:
                        raise ValueError(f"unexpected weight {name!r}")
                    param.weight_loader(param, tensor)  # type: ignore[attr-defined]
                    return name
            return None
        prefix, expert, part = m.group(1), int(m.group(2)), self._PARTS[m.group(3)]
        experts = getattr(self.get_submodule(f"{prefix}.mlp"), "experts", None)
        if not isinstance(experts, FusedMoE) or not 0 <= expert < experts.num_experts:
            raise ValueError(f"unexpected weight {name!r}")
        experts.weight_loader(tensor, expert, part)
        return f"{prefix}.mlp.experts#{expert}.{part}"

    def _expected_names(self, params: dict[str, nn.Parameter]) -> list[str]:
        names = []
        for name in super()._expected_names(params):
            if name.endswith(".experts.w13"):
                module = name.removesuffix(".w13")
                n = self.get_submodule(module).num_experts
                names += [f"{module}#{e}.{p}" for e in range(n) for p in ("gate", "up")]
            elif name.endswith(".experts.w2"):
                module = name.removesuffix(".w2")
                n = self.get_submodule(module).num_experts
                names += [f"{module}#{e}.down" for e in range(n)]
            else:
                names.append(name)
        return names


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral 8x7B / 8x22B and other `block_sparse_moe` checkpoints."""

    _EXPERT = re.compile(
        r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight"
    )
    _PARTS = {"w1": "gate", "w3": "up", "w2": "down"}
    _RENAMES = {".block_sparse_moe.gate.": ".mlp.gate."}
