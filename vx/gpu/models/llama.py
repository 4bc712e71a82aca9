"""The Llama family: Llama 2/3 (incl. llama3 rope scaling), SmolLM2, Mistral, Qwen2.

Runs in: each Worker process.

One decoder serves all three HF architectures; they differ only in config fields:
Qwen2 has a bias on q/k/v, Llama may have `attention_bias`/`mlp_bias`, small models tie the
LM head to the embedding. q/k/v and gate/up are stored fused (one GEMM each) and filled by
`load_weights` from HF's separate tensors.

The forward pass is flat over tokens: `input_ids`/`positions` are [T] for every scheduled token
of every request, and attention goes through `vx.gpu.attention.paged.paged_attention`, which writes
k/v into the paged cache and attends through the block tables in `attn_metadata`. No Python
loop runs per request, and nothing reads a tensor value back to the host.

This file is the family only (embedding, rotary, decoder layers of attention + MLP + norms, LM
head, weight loading), with no CPU or CUDA branch: which kernel an op takes on which device is
the layers' business (`vx.gpu.layers`). Other ways of running a step are the Worker's, picked
once at start-up (`vx.gpu.model_runner`): the fused CPU step (`vx.gpu.cpu.fused_step`) replaces
`LlamaModel.run_layers` between `embed` and `final_norm`; CUDA graphs (`vx.gpu.cuda_graphs`)
replay `forward`.

The stack is also the other families' (qwen3.py, mixtral.py, qwen3_moe.py, phi3.py, gemma.py):
`LlamaForCausalLM.build_blocks` gives each layer its attention and MLP, `args_cls` reads the
config, `model_cls` (with its `layer_cls`/`norm_cls`) is the stack, and `LlamaAttention.project`
is the one step between the hidden states and the attention that a family may change.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from vx.gpu.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    apply_rotary,
    default_weight_loader,
)
from vx.gpu.layers.rotary import rotary_dim
from vx.gpu.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from vx.gpu.parallel_state import get_pp_indices, hand_off_min_tokens, shift_layers

__all__ = [
    "LlamaForCausalLM", "MistralForCausalLM", "ModelArgs", "PPMissingLayer", "Qwen2ForCausalLM",
]

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim // 2]

# HF tensor name suffix -> (fused parameter suffix, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


#: a checkpoint tensor of decoder layer N
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds (vLLM's name): no parameters, and never called."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """The config fields this model reads, normalised across HF versions and architectures."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: dict
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    #: the MLP's activation (HF's `hidden_act`, or Gemma's `hidden_activation`)
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelArgs:
        arch = (getattr(cfg, "architectures", None) or [""])[0]
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        window = getattr(cfg, "sliding_window", None)
        if hasattr(cfg, "use_sliding_window") and not cfg.use_sliding_window:
            window = None  # Qwen2/Qwen3 configs carry a window they do not use
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position=cfg.max_position_embeddings,
            rope=_rope_dict(cfg),
            qkv_bias=attention_bias or arch.startswith("Qwen2"),
            o_bias=attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            sliding_window=window,
            hidden_act=getattr(cfg, "hidden_activation", None)
            or getattr(cfg, "hidden_act", "silu"),
        )


def _rope_dict(cfg: Any) -> dict:
    """rope_theta + scaling as one dict, from transformers 5 (`rope_parameters`) or 4.x fields."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    rope = dict(getattr(cfg, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return rope


class LlamaAttention(nn.Module):
    def __init__(self, a: ModelArgs, attn_fn: Callable, **kw: Any) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, bias=a.qkv_bias, **kw
        )
        self.o_proj = RowParallelLinear(
            a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias, **kw
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = a.head_dim
        self.q_size = self.num_heads * a.head_dim
        self.kv_size = self.num_kv_heads * a.head_dim
        self.scale = a.head_dim**-0.5
        self.attn_fn = attn_fn
        #: the leading dims of each q/k head the rotary turns
        self.rotary_dim = rotary_dim(a.head_dim, a.rope)
        if self.rotary_dim != a.head_dim and type(self).project is LlamaAttention.project:
            raise NotImplementedError("partial rotary needs a family's own `project` (Phi-3)")

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: Any,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], or the rows `keep` only (every row's K/V is written)."""
        o = self.attend(rope, x, kv_cache, attn_metadata)
        if keep is not None:
            if keep.numel() == 0:
                return x.new_empty((0, x.shape[1]))
            o = o[keep]
        return self.o_proj(o)

    def attend(
        self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: Any
    ) -> torch.Tensor:
        """[T, hidden] -> the attention's output before `o_proj`, [T, Hq * D] (this rank's
        heads), having written every row's K/V."""
        q, k, v = self.project(rope, x)
        o = self.attn_fn(q, k, v, kv_cache, attn_metadata, self.scale)  # [T, Hq, D]
        return o.reshape(x.shape[0], self.q_size)

    def project(self, rope: Rope, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D], q and k rotated. A family with more
        between the projection and the attention (q/k norms) overrides this alone."""
        t = x.shape[0]
        qk_size = self.q_size + self.kv_size
        qkv = self.qkv_proj.rope_forward(x, *rope)  # [T, q + 2 kv], q and k rotated (AMX)
        if qkv is not None:
            qk = qkv[:, :qk_size].view(t, -1, self.head_dim)  # [T, Hq+Hkv, D]
        else:
            qkv = self.qkv_proj(x)
            # q and k are adjacent in the fused output: rotate both heads in one pass.
            qk = apply_rotary(qkv[:, :qk_size].view(t, -1, self.head_dim), *rope)
        q = qk[:, : self.num_heads]  # [T, Hq, D]
        k = qk[:, self.num_heads :]  # [T, Hkv, D]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, a: ModelArgs, **kw: Any) -> None:
        super().__init__()
        if a.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {a.hidden_act!r} is not supported")
        self.gate_up_proj = MergedColumnParallelLinear(
            a.hidden_size, [a.intermediate_size] * 2, bias=a.mlp_bias, silu_pairs=True, **kw
        )
        self.down_proj = RowParallelLinear(
            a.intermediate_size, a.hidden_size, bias=a.mlp_bias, **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    """A pre-norm block. Besides `forward` it runs in two halves, for a pipeline stage that
    hands its last layer on (`LlamaModel.run_layers`): `attend` (the input norm and the
    attention, which needs this stage's KV cache) and `finish` (the o_proj, the norm and the
    MLP, which need no state; the next stage holds a copy of them, `tail_only`)."""

    def __init__(self, a: ModelArgs, self_attn: nn.Module, mlp: nn.Module, **kw: Any) -> None:
        super().__init__()
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, **dd)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, **dd)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: Any,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`keep`: the rows (of T) to carry past the attention; the others' K/V are written,
        and nothing after the attention needs them (the last layer of a step)."""
        h, residual = self._input_norm(x, residual)
        h = self.self_attn(rope, h, kv_cache, attn_metadata, keep)
        if keep is not None:
            residual = residual[keep]
            if keep.numel() == 0:
                return h, residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def attend(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` up to the attention's output before `o_proj`: (that [T, Hq * D], the
        residual [T, hidden]); `finish` completes the layer."""
        h, residual = self._input_norm(x, residual)
        return self.self_attn.attend(rope, h, kv_cache, attn_metadata), residual

    def _input_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first norm: (normed, residual); the previous block's residual add is fused
        into it (the first block's residual is its input)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def finish(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of `forward` after `attend`: (MLP output, residual), [T, hidden] each."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
        return self.mlp(h), residual

    def tail_only(self) -> None:
        """Drop what `finish` does not use (the input norm, the attention but its o_proj):
        the copy a later pipeline stage keeps of the previous stage's last layer."""
        self.input_layernorm = PPMissingLayer()
        for name, _ in list(self.self_attn.named_children()):
            if name != "o_proj":
                setattr(self.self_attn, name, PPMissingLayer())

    @staticmethod
    def in_tail(name: str) -> bool:
        """Whether parameter `name` (relative to the layer) is one `tail_only` keeps."""
        return not name.startswith(("input_layernorm.", "self_attn.")) or name.startswith(
            "self_attn.o_proj."
        )


class LlamaModel(nn.Module):
    """The decoder stack: embedding, layers, final norm.

    A forward is three stages, each a method, so that a runner may replace the middle one (the
    fused CPU step runs every layer in one C call, `vx.gpu.cpu.fused_step`) and keep the others:
    `embed` -> `run_layers` -> `final_norm`. Invariant: `forward` is exactly those three.

    `blocks` builds layer i's attention and MLP (`LlamaForCausalLM.build_blocks`); it is called
    at construction only, never kept.

    Pipeline parallel: `pp_layers` = [start, end) are this stage's layers; the others are
    `PPMissingLayer`s (the layer indices, and with them the checkpoint names, stay global).
    The embedding is built on the first stage (and on the last where the head is tied to it),
    the final norm on the last; `run_layers` runs this stage's layers only. With `tail_copy`
    a stage also holds the previous stage's last layer's `finish` part (`tail_only`), so that
    the previous stage may hand that part of a step on to it (`run_layers`' `hand_off` and
    `finish_prev`). With `shadow_layers` = n it holds the previous stage's last n layers
    whole as well (their KV caches too: the stage's caches start at `cache_start`), runs
    them on a step that hands off, and the tail copy is then of the layer before them; the
    previous stage, built with `shadowed_layers` = n, stops n layers earlier on such a step.
    """

    #: the decoder layer (norms and residuals around the attention and MLP `blocks` builds)
    #: and the norm class; Gemma's stack has its own (models/gemma.py)
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(
        self,
        a: ModelArgs,
        blocks: Callable[..., tuple],
        *,
        pp_layers: tuple[int, int] | None = None,
        tail_copy: bool = False,
        shadow_layers: int = 0,
        shadowed_layers: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__()
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        start, end = pp_layers or (0, a.num_layers)
        self.start_layer, self.end_layer = start, end
        #: the previous stage's last layers held here whole, and this stage's last layers the
        #: next stage holds whole (run there on a step that hands off)
        self.shadow_layers, self.shadowed_layers = shadow_layers, shadowed_layers
        #: the first layer whose KV cache this stage holds (`kv_caches[0]` of `run_layers`)
        self.cache_start = start - shadow_layers
        #: the layer before `cache_start` whose `finish` part this stage holds, or None
        self.tail_layer = self.cache_start - 1 if tail_copy and start > 0 else None
        last = end == a.num_layers
        # The lookup table is never quantized (only the linears and the LM head are).
        ekw = {k: v for k, v in kw.items() if k != "quantization"}
        self.embed_tokens = (
            VocabParallelEmbedding(a.vocab_size, a.hidden_size, **ekw)
            if start == 0 or (last and a.tie_word_embeddings)
            else PPMissingLayer()
        )
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope, **dd)
        self.layers = nn.ModuleList(
            self.layer_cls(a, *blocks(a, i, **kw), **kw)
            if self.cache_start <= i < end or i == self.tail_layer
            else PPMissingLayer()
            for i in range(a.num_layers)
        )
        if self.tail_layer is not None:
            self.layers[self.tail_layer].tail_only()
        self.norm = self.norm_cls(a.hidden_size, a.rms_norm_eps, **dd) if last else PPMissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: Any,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden] final hidden states, or [len(keep), hidden] for the rows `keep` of T:
        the last layer then runs its o_proj, MLP and norms on those rows alone (as llama.cpp
        does for the rows it needs no output of). Every layer writes every row's K/V."""
        x, rope = self.embed(input_ids, positions)
        return self.final_norm(*self.run_layers(x, rope, kv_caches, attn_metadata, keep))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """[T] ids and positions -> (embeddings [T, hidden], the rotary's cos, sin for the
        positions, shared by every layer)."""
        return self.embed_tokens(input_ids), self.rope(positions)

    def rope(self, positions: torch.Tensor) -> Rope:
        """The rotary's cos, sin for `positions` (`embed`'s second part: a later pipeline
        stage, which does not embed, needs it alone)."""
        return self.rotary.lookup(positions)

    def run_layers(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_caches: list[KVCache],
        attn_metadata: Any,
        keep: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        *,
        finish_prev: bool = False,
        hand_off: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's decoder layers over `embed`'s output (or, on a later pipeline stage,
        the previous stage's output `x` and `residual`): (last MLP output, residual),
        [T, hidden] each, or the rows `keep` only (see `forward`). `kv_caches` holds the
        caches of layers [`cache_start`, `end_layer`), in order.

        `hand_off`: the layers stop `shadowed_layers` early, the last one after its attention,
        and the result is that layer's (attention output [T, Hq * D], residual) for the next
        stage to finish. `finish_prev`: `x` is such an attention output of the previous
        stage, finished here first (`tail_layer`), and the shadow layers run before this
        stage's own."""
        start, end = self.start_layer, self.end_layer
        first = self.cache_start
        if len(kv_caches) != end - first:
            raise ValueError(f"{len(kv_caches)} KV caches for {end - first} layers")
        layers = self.layers
        if finish_prev:
            assert self.tail_layer is not None and residual is not None
            x, residual = layers[self.tail_layer].finish(x, residual)
            start = first
        if hand_off:
            end -= self.shadowed_layers
        for i in range(start, end):
            if hand_off and i == end - 1:
                x, residual = layers[i].attend(rope, x, residual, kv_caches[i - first],
                                               attn_metadata)  # fmt: skip
                break
            x, residual = layers[i](
                rope, x, residual, kv_caches[i - first], attn_metadata,
                keep if i == end - 1 else None,
            )  # fmt: skip
        assert residual is not None
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last residual add and RMSNorm: the final hidden states (none for no rows)."""
        if x.shape[0] == 0:
            return x
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    Invariants: parameters are created empty on `device` in `dtype` and every one of them is
    filled by `load_weights` (which raises if any is left out); `num_heads`/`num_kv_heads` are
    per tensor-parallel rank; `forward` never synchronises with the host.

    A family that differs from Llama only in its config fields, its attention or its MLP
    subclasses this and overrides `args_cls` and/or `build_blocks` (models/qwen3.py,
    models/moe.py); the decoder stack, the LM head and the weight loading stay these.
    """

    #: reads the HF config into the fields the model uses
    args_cls: type[ModelArgs] = ModelArgs
    #: the decoder stack
    model_cls: type[LlamaModel] = LlamaModel
    #: `forward` never reads a value back to the host, so CUDA graphs may capture it
    graph_capturable: bool = True

    @staticmethod
    def pp_head_layers(a: ModelArgs) -> float:
        """The LM head's weight in layers (`get_pp_indices`): a dense MLP's layer. A family
        whose layers cost otherwise (MoE: the experts a step touches) says 0, an even split."""
        return _pp_head_layers(a)

    def __init__(
        self,
        hf_config: Any,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        # Imported here, not at module level: tests may install their own attention module.
        from vx.gpu.attention.paged import paged_attention

        a = self.args_cls.from_hf(hf_config)
        self.args = a
        self.attn_fn = paged_attention
        #: Mistral-style sliding window (tokens) the attention does NOT implement, or None:
        #: the runner caps max_model_len at it (a Qwen2 window on some layers only).
        self.sliding_window = None
        #: per layer: the sliding window (keys) its attention implements, or None (global)
        self.attention_windows: tuple[int | None, ...] = (None,) * a.num_layers
        types = getattr(hf_config, "layer_types", None) or ()
        if a.sliding_window and a.sliding_window < a.max_position:
            if all(t == "sliding_attention" for t in types):
                # every layer windowed (Mistral, Phi-3): the windowed attention, the C kernels
                # on CPU (in the fused step too)
                from vx.gpu.attention.windowed import WindowedAttention

                self.attn_fn = WindowedAttention(a.sliding_window, None)
                self.attention_windows = (a.sliding_window,) * a.num_layers
                self.graph_capturable = False  # it reads the step's lengths back
            else:
                self.sliding_window = a.sliding_window
        self.dtype, self.device = dtype, torch.device(device)
        kw = {"dtype": dtype, "device": self.device, "tp_rank": tp_rank, "tp_size": tp_size}
        #: None, "int8" or "int4": weight-only quantization of every linear and the LM head
        #: (vx.gpu.layers.quantization), applied by `process_weights_after_loading`.
        self.quantization = quantization
        head = self.pp_head_layers(a)
        start, end = get_pp_indices(a.num_layers, pp_rank, pp_size, head)
        #: this pipeline stage holds the final norm and the LM head (and samples)
        self.is_last_stage = end == a.num_layers
        pp: dict[str, Any] = {}
        if self.hands_off_tails():
            pp["shadowed_layers"] = shift_layers(a.num_layers, pp_rank, pp_size, head)
            if start > 0:
                pp["tail_copy"] = True
                pp["shadow_layers"] = shift_layers(a.num_layers, pp_rank - 1, pp_size, head)
        self.model = self.model_cls(
            a, self.build_blocks, quantization=quantization, pp_layers=(start, end), **pp, **kw
        )
        self.lm_head: nn.Module = PPMissingLayer()
        if self.is_last_stage:
            self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, **kw)
            self.lm_head.quantization = quantization
            if a.tie_word_embeddings:
                self.lm_head.tie(self.model.embed_tokens)
        attn = self.model.layers[start].self_attn
        #: the layers whose KV caches this stage holds: its own (all of them without pipeline
        #: parallel) and its shadow layers
        self.num_layers = end - self.model.cache_start
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = a.head_dim
        self.vocab_size = a.vocab_size
        self.max_position = a.max_position

    @classmethod
    def hands_off_tails(cls) -> bool:
        """Whether, under pipeline parallel, a stage may hand its last layer's `finish` part
        on to the next stage (`vx.gpu.parallel_state.hand_off_min_tokens`): every stage
        answers alike, and a stage after the first then holds a copy of that part."""
        finish = getattr(cls.model_cls.layer_cls, "finish", None)
        return finish is not None and hand_off_min_tokens() is not None

    def build_blocks(self, a: ModelArgs, layer: int, **kw: Any) -> tuple[nn.Module, nn.Module]:
        """Layer `layer`'s (attention, MLP) modules."""
        return LlamaAttention(a, self.attn_fn, **kw), LlamaMLP(a, **kw)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: Any,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states (rows `keep` only, if
        given: see LlamaModel.forward)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden)

    def compute_logits_of(
        self, hidden: torch.Tensor, token_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """[N, hidden], [K] -> [N, K] float32, the logits of those tokens only, or None where
        the head cannot gather them (`ParallelLMHead.compute_logits_of`)."""
        return self.lm_head.compute_logits_of(hidden, token_ids)

    def greedy_ids(self, hidden: torch.Tensor) -> np.ndarray | None:
        """[N, hidden] -> [N] argmax of the logits where the LM head gets it without them."""
        return self.lm_head.greedy_ids(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from (HF name, full tensor) pairs, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self._on_stage(name):
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue  # tied: the embedding is the head
            key = self.load_family_weight(params, name, tensor)
            if key is not None:
                loaded.add(key)
                continue
            for hf_part, (fused_part, shard_id) in _STACKED.items():
                if hf_part in name:
                    target = name.replace(hf_part, fused_part)
                    param = params.get(target)
                    if param is None:
                        raise ValueError(f"unexpected weight {name!r}")
                    param.weight_loader(param, tensor, shard_id)
                    loaded.add(f"{target}#{shard_id}")
                    break
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"unexpected weight {name!r}")
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        missing = [n for n in self._expected_names(params) if n not in loaded]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")

    def _on_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a module of this pipeline stage."""
        m = _LAYER_NAME.match(name)
        if m is not None:
            layer = int(m.group(1))
            if layer == self.model.tail_layer:
                return self.model.layers[layer].in_tail(name[m.end() :])
            return self.model.cache_start <= layer < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return not isinstance(self.model.embed_tokens, PPMissingLayer)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last_stage
        return True

    def load_family_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        """A family's own checkpoint tensors (experts): load `name` and return the key that
        `_expected_names` lists for it, or None for the Llama rules to load it."""
        return None

    def _expected_names(self, params: dict[str, nn.Parameter]) -> list[str]:
        names = []
        for name in params:
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if ".qkv_proj." in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(name)
        return names


def _pp_head_layers(a: ModelArgs) -> float:
    """The LM head's weights in layers' worth (the cost a decode step reads on the last
    pipeline stage, `get_pp_indices`), for a dense MLP."""
    attn = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    return a.vocab_size * a.hidden_size / (attn + 3 * a.hidden_size * a.intermediate_size)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a (possibly absent) sliding window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on q/k/v (set from the architecture name in ModelArgs)."""
