"""Gemma 2 and Gemma 3 (text): the Llama decoder's parts, rearranged the Gemma way.

Runs in: each Worker process.

What differs from Llama (HF's Gemma2*/Gemma3Text* classes are the reference):
- norms are `GemmaRMSNorm` ((1 + w), multiplied in fp32), and each layer has four: before and
  after the attention, before and after the MLP (`GemmaDecoderLayer`);
- the embedding is scaled by sqrt(hidden) (rounded to the model dtype, as HF);
- the MLP is GeGLU (gelu with the tanh approximation);
- attention scale is `query_pre_attn_scalar ** -0.5`; Gemma 2 soft-caps attention logits
  (`attn_logit_softcapping`) and both may soft-cap the final logits (`final_logit_softcapping`);
- `layer_types` alternates sliding-window and global layers; a sliding layer attends to its
  last `sliding_window` keys (`vx.gpu.attention.windowed.WindowedAttention`, which also does
  the soft-capping, in the C kernels on CPU); a global layer without soft-capping takes
  `paged_attention`;
- Gemma 3 adds q/k RMSNorms per head, and rotates its sliding layers with their own rope
  (`rope_parameters["sliding_attention"]`: base 10 000) and its global ones with theirs.

The fused CPU step runs these blocks in C (its Gemma form: the same norm, GeGLU and
attention kernels as the module path, which takes them on CPU in bf16). A model here is not
CUDA-graph capturable where a layer takes the windowed attention (it reads lengths back).
The KV cache keeps a group per kind of layer (`vx.gpu.kv_cache.kv_cache_groups`): the windowed
layers' blocks are freed as their windows slide, the global layers' kept
(`vx.core.hybrid_kv_cache_manager`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vx.gpu.attention.windowed import WindowedAttention
from vx.gpu.layers.linear import (
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    apply_rotary,
    gelu_tanh_and_mul,
)
from vx.gpu.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    ModelArgs,
    Rope,
)

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"]

_SLIDING = "sliding_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaArgs(ModelArgs):
    """ModelArgs plus Gemma's: per-layer windows, soft-caps, q/k norms, the local rope."""

    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    #: per layer: the sliding window (keys) or None for a global layer
    windows: tuple[int | None, ...]
    qk_norm: bool
    #: the sliding layers' rope (Gemma 3), or None: every layer turns with `rope`
    rope_local: dict | None

    @classmethod
    def from_hf(cls, cfg: Any) -> GemmaArgs:
        params = getattr(cfg, "rope_parameters", None) or {}
        per_type = isinstance(params, dict) and _SLIDING in params
        base = ModelArgs.from_hf(cfg)
        if per_type:  # Gemma 3: one rope dict per layer type
            base = dataclasses.replace(base, rope=dict(params["full_attention"]))
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * base.num_layers)
        window = getattr(cfg, "sliding_window", None)
        return cls(
            # every window is per layer (`windows`): no whole-model cap (LlamaForCausalLM)
            **{**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelArgs)},
               "sliding_window": None},
            query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
            final_softcap=getattr(cfg, "final_logit_softcapping", None),
            windows=tuple(window if t == _SLIDING else None for t in types),
            qk_norm=str(getattr(cfg, "model_type", "")).startswith("gemma3"),
            rope_local=dict(params[_SLIDING]) if per_type else None,
        )  # fmt: skip


class GemmaAttention(LlamaAttention):
    """One Gemma layer's attention: its window, soft-cap, rope and (Gemma 3) q/k norms."""

    def __init__(self, a: GemmaArgs, layer: int, **kw: Any) -> None:
        window = a.windows[layer]
        if window is None and a.attn_softcap is None:
            from vx.gpu.attention.paged import paged_attention as attn_fn
        else:
            attn_fn = WindowedAttention(window, a.attn_softcap)
        super().__init__(a, attn_fn, **kw)
        self.scale = a.query_pre_attn_scalar**-0.5
        #: which of `GemmaModel.embed`'s ropes this layer turns with (1: the local one)
        self.rope_index = int(window is not None and a.rope_local is not None)
        self.q_norm = self.k_norm = None
        if a.qk_norm:
            dd = {"dtype": kw["dtype"], "device": kw["device"]}
            self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, **dd)
            self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, **dd)

    def project(self, rope: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rope = rope[self.rope_index]
        if self.q_norm is None:
            return super().project(rope, x)
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = self.q_norm(qkv[:, :q_end].reshape(-1, d)).view(t, -1, d)  # per head, as Qwen3
        k = self.k_norm(qkv[:, q_end:k_end].reshape(-1, d)).view(t, -1, d)
        qk = apply_rotary(torch.cat((q, k), dim=1), *rope)
        v = qkv[:, k_end:].view(t, self.num_kv_heads, d)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, a: ModelArgs, **kw: Any) -> None:
        super().__init__()
        if a.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"Gemma hidden_activation {a.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(
            a.hidden_size, [a.intermediate_size] * 2, bias=False, **kw
        )
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """x -> x + post_attn_norm(attn(input_norm(x))) -> + post_ff_norm(mlp(pre_ff_norm(.))).

    Same protocol as LlamaDecoderLayer (returns (block output, residual); the next layer's
    first norm adds them), so `LlamaModel.run_layers` and `final_norm` drive it unchanged.
    """

    def __init__(self, a: ModelArgs, self_attn: nn.Module, mlp: nn.Module, **kw: Any) -> None:
        super().__init__()
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        self.self_attn, self.mlp = self_attn, mlp
        norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
        for name in norms:
            setattr(self, f"{name}_layernorm", GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, **dd))

    def forward(
        self,
        rope: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: Any,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, attn_metadata, keep)
        if keep is not None:
            residual = residual[keep]
            if keep.numel() == 0:
                return h, residual
        h = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(LlamaModel):
    """The Llama stack with Gemma's layers and norm, a scaled embedding and, for Gemma 3, the
    sliding layers' own rotary. `embed` gives every layer both ropes (global, local)."""

    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, a: GemmaArgs, blocks: Any, **kw: Any) -> None:
        super().__init__(a, blocks, **kw)
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        # HF: embed * tensor(sqrt(hidden)) cast to the weight's dtype
        self.register_buffer(
            "normalizer", torch.tensor(a.hidden_size**0.5).to(**dd), persistent=False
        )
        self.rotary_local = None
        if a.rope_local is not None:
            self.rotary_local = RotaryEmbedding(a.head_dim, a.max_position, a.rope_local, **dd)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.embed_tokens(input_ids) * self.normalizer, self.rope(positions)

    def rope(self, positions: torch.Tensor) -> Any:
        rope: Rope = self.rotary.lookup(positions)
        local = rope if self.rotary_local is None else self.rotary_local.lookup(positions)
        return rope, local


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (2B, 9B, 27B)."""

    args_cls = GemmaArgs
    model_cls = GemmaModel

    def __init__(self, hf_config: Any, **kw: Any) -> None:
        super().__init__(hf_config, **kw)
        a = self.args
        assert isinstance(a, GemmaArgs)
        self.attention_windows = a.windows
        # the windowed attention reads the step's lengths back to the host
        self.graph_capturable = all(w is None for w in a.windows) and a.attn_softcap is None

    def build_blocks(self, a: ModelArgs, layer: int, **kw: Any) -> tuple[nn.Module, nn.Module]:
        assert isinstance(a, GemmaArgs)
        return GemmaAttention(a, layer, **kw), GemmaMLP(a, **kw)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, soft-capped where the config says (tanh keeps
        the order, so the LM head's argmax `greedy_ids` stays the capped one's)."""
        logits = super().compute_logits(hidden)
        cap = self.args.final_softcap  # type: ignore[attr-defined]
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_logits_of(
        self, hidden: torch.Tensor, token_ids: torch.Tensor
    ) -> torch.Tensor | None:
        logits = super().compute_logits_of(hidden, token_ids)
        cap = self.args.final_softcap  # type: ignore[attr-defined]
        return logits if cap is None or logits is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (1B; the text stack of the larger ones): q/k norms, two rope bases."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text stack of the multimodal Gemma 3 checkpoints (4B, 12B, 27B): built from
    `text_config`, loaded from the language model's weights; the vision tower and the projector
    are skipped, so image inputs are not served."""

    #: where the language model's `model.` lives in these checkpoints (older, newer layout)
    _PREFIXES = ("language_model.model.", "model.language_model.")
    #: the image side, not loaded
    _VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
               "model.multi_modal_projector.")  # fmt: skip

    def __init__(self, hf_config: Any, **kw: Any) -> None:
        text = copy.copy(hf_config.text_config)
        # HF ties the head by the outer config's flag (the text config's may say otherwise)
        text.tie_word_embeddings = getattr(hf_config, "tie_word_embeddings", True)
        super().__init__(text, **kw)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._text_weights(weights))

    def _text_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            prefix = next((p for p in self._PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                yield "model." + name.removeprefix(prefix), tensor
            elif name in ("lm_head.weight", "language_model.lm_head.weight"):
                yield "lm_head.weight", tensor
            elif not name.startswith(self._VISION):
                raise ValueError(f"unexpected weight {name!r}")
