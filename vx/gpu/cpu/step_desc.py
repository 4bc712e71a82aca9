"""The fused CPU step's descriptions: ctypes mirrors of `csrc/decode_step.c`'s structs (a
linear, a layer, a MoE block, a KV-cache group, the step), and the functions that fill them from a
loaded model's modules once, at load (`vx.gpu.cpu.fused_step.FusedDecode.build`).

Runs in: each Worker process.

Invariant: each `_fields_` list is the C struct of the same name in `decode_step.c`, field for
field and in order; a description points at the final weight copies, so it is built after the
weights are processed and lives as long as they do.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from vx import envs

__all__ = [
    "GreedyTailDesc",
    "KVGroupDesc",
    "LayerDesc",
    "LinearDesc",
    "MoeDesc",
    "ScreenHeadDesc",
    "StepDesc",
    "block_extras",
    "linear_desc",
    "model_family",
    "moe_desc",
    "moe_scratch_bytes",
    "norm_modules",
    "ptr",
    "screen_head",
    "split_policy",
]

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class LinearDesc(ctypes.Structure):
    _fields_ = [
        ("w", _P), ("q", _P), ("scale", _P), ("bias", _P), ("n", _I64), ("k", _I64), ("vn", _P),
        ("q4", _P), ("s4", _P), ("z4", _P), ("cw", _P), ("ch", _P), ("craw", _P),
        ("panels", _P), ("vs", _P),
    ]  # fmt: skip


class GreedyTailDesc(ctypes.Structure):
    """`vx_greedy_tail` (see `FusedDecode.greedy_step`)."""

    _fields_ = [
        ("ids", _P), ("positions", _P), ("embed", _P), ("cos_table", _P), ("sin_table", _P),
        ("norm", _P), ("head", _P), ("vocab", _I64), ("out", _P),
    ]  # fmt: skip


class ScreenHeadDesc(ctypes.Structure):
    """`vx_screen_head` (see `FusedDecode.greedy_step`)."""

    _fields_ = [
        ("q", _P), ("s", _P), ("bound", _P), ("w", _P), ("a", _P), ("idx", _P), ("cand", _P),
        ("cap", _I64), ("vnni", _I64),
    ]  # fmt: skip


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("in_norm", _P), ("post_norm", _P),
        ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
        ("k_cache", _P), ("v_cache", _P),
        ("q_norm", _P), ("k_norm", _P), ("attn_out_norm", _P), ("mlp_out_norm", _P),
        ("window", _I32), ("local_rope", _I32), ("softcap", _F32), ("group", _I32),
        ("moe", _P),
    ]  # fmt: skip


class MoeDesc(ctypes.Structure):
    """A MoE layer's MLP (C `vx_moe`)."""

    _fields_ = [
        ("router", LinearDesc), ("w13", _P), ("w2", _P), ("E", _I64), ("k", _I64), ("I", _I64),
        ("renorm", _I32), ("w_f32", _I32), ("vnni", _I32),
    ]  # fmt: skip


def moe_scratch_bytes(t: int, moes: list[MoeDesc], hidden: int) -> int:
    """Bytes of `vx_moe_block`'s scratch for a step of t rows (its carving, each part 64-byte
    aligned), the most any of the model's MoE layers needs."""

    def al(n: int) -> int:
        return (n + 63) // 64 * 64

    need = 0
    for m in moes:
        n = t * m.k
        need = max(need, sum(al(b) for b in (
            t * m.router.n * 2, n * 4, n * 8, n * 8, m.E * 8, (n + 32) * hidden * 2,
            (n + 32) * m.I * 2, n * hidden * 2, n * 2 * m.I * 2,
        )))  # fmt: skip
    return need


def moe_desc(mlp: Any, keep: list) -> MoeDesc | None:
    """The C view of a `SparseMoeBlock` whose experts take the AMX or the VNNI experts' GEMM
    (`CpuExperts.grouped`, `grouped_vnni`), else None (the model then runs its module path).
    `keep` collects what the description points at that nothing else holds."""
    from vx.gpu.layers.cpu_experts import CpuExperts
    from vx.gpu.layers.linear_method import PaddedSkinnyLinear
    from vx.gpu.models.mixtral import SparseMoeBlock

    if type(mlp) is not SparseMoeBlock:
        return None
    moe, gate = mlp.experts, mlp.gate
    experts = moe.experts_fn
    if not isinstance(experts, CpuExperts) or moe.tp_size != 1:
        return None
    grouped = experts.grouped if experts.grouped is not None else experts.grouped_vnni
    if grouped is None:
        return None
    if gate.quant is not None or gate.bias is not None or gate.weight.shape[0] != moe.num_experts:
        return None
    padded = gate.method.find(PaddedSkinnyLinear)
    if padded is not None:  # the module path's router: the skinny GEMM on the padded copy
        w = padded.padded
        if padded is not gate.method or not w.is_contiguous():
            return None
        router = LinearDesc(w.data_ptr(), None, None, None, w.shape[0], w.shape[1])
    else:
        router = linear_desc(gate, False)
        if router is None:
            return None
    keep.append(grouped)
    return MoeDesc(
        router, grouped[0].ctypes.data, grouped[1].ctypes.data, moe.num_experts, moe.top_k,
        experts.inter, int(moe.renormalize), int(moe.weights_in_fp32),
        int(experts.grouped is None),
    )  # fmt: skip


class KVGroupDesc(ctypes.Structure):
    """One KV-cache group's slots and block tables (C `vx_kv_group`)."""

    _fields_ = [
        ("slots", _P), ("bt", _P), ("bt_s", _I64), ("p_bt", _P), ("p_bt_s", _I64),
        ("max_len", _I64),
    ]  # fmt: skip


def split_policy(vnni: bool) -> tuple[int, int]:
    """(parts, least rows a part) for `vx_llama_decode_split` at decode-only steps (parts < 2:
    never), fixed when the model's step is built (the Worker has set its threads by then).

    `VX_CPU_SPLIT_STEP`: the parts (0 or 1: off); unset, 2 where it was measured not to lose:
    two threads on the VNNI GEMM (AVX512-BF16 without AMX). Each part needs at least
    `VX_CPU_SPLIT_MIN_ROWS` rows (default 16): every part streams all the weights, so small
    steps, bound by that stream, lose (measured on a 2-core Zen 5, SmolLM2, in alternated
    rounds: split steps lost at 16 rows and won from 32). The rows are cut in proportion to each
    thread's measured speed (`vx_split_cut`; `vx_set_split_adapt(0)`, for tests: evenly). A
    thread done with its rows takes half of those the other has left, from its next layer on
    (`vx/gpu/cpu/csrc/split_step.c`; `vx_set_split_steal(0)`, for tests: never)."""
    parts = envs.VX_CPU_SPLIT_STEP
    if parts is None:
        parts = 2 if vnni and torch.get_num_threads() == 2 else 0
    return (parts if parts >= 2 else 0), envs.VX_CPU_SPLIT_MIN_ROWS


class StepDesc(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("T", "H", "Hq", "Hkv", "D", "I", "NB", "BS")),
        ("c_sh", _I64), ("c_sb", _I64),
        ("eps", _F32), ("scale", _F32),
        ("max_len", _I32), ("quant_rows", _I32), ("fast", _I32), ("skinny_rows", _I32),
        ("cos", _P), ("sin", _P), ("slots", _P), ("bt", _P), ("bt_s", _I64), ("lens", _P),
        ("nd", _I64), ("np", _I64), ("p_starts", _P), ("p_lens", _P), ("p_computed", _P),
        ("p_bt", _P), ("p_bt_s", _I64),
        ("x", _P), ("residual", _P), ("h", _P), ("qkv", _P), ("attn", _P), ("gu", _P),
        ("act", _P), ("keep", _P), ("nkeep", _I64),
        ("R", _I64), ("gemma", _I32), ("pad", _I32), ("cos_l", _P), ("sin_l", _P),
        ("groups", _P), ("moe_scratch", _P),
    ]  # fmt: skip


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear_desc(layer: Any, avx2: bool) -> LinearDesc | None:
    """The C view of one linear, or None where the C kernels would not be the module's path
    (`avx2`: the AVX2 skinny GEMM of the layer's `WideWeight`, and its int8 or int4 twin)."""
    if avx2:
        wide = layer.wide
        w = wide.bf16 if wide is not None and wide.skinny_rows else None
    elif layer.plain is None and layer.vnni is not None and layer.vnni.all_rows:
        # batch-invariant (`build(..., batch_invariant=True)`): no skinny GEMM, the step's
        # `skinny_rows` is 0 and the VNNI (or AMX) copy takes every row; the plain weight is
        # only the description's shape and bias check
        w = layer.weight.data
    else:
        w = layer.plain
    bias = layer.bias
    if w is None or not w.is_contiguous() or layer.tp_size != 1:
        return None
    n, k = w.shape
    if n % 16 or k % 32 or k > 16384:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    q = scale = None
    q4 = layer.quant.avx2_int4 if layer.quant is not None and avx2 else None
    if layer.quant is not None and q4 is None:
        if layer.quant.method != "int8":
            return None
        q = layer.quant.avx2_qweight if avx2 else layer.quant.qweight
        if q is None:
            return None
        scale = layer.quant.scales
    vn = vs = None
    if not avx2 and layer.vnni is not None:  # a gate-up's SiLU copy: the C step's own GEMM
        vn, vs = (None, layer.vnni.packed) if layer.vnni.silu else (layer.vnni.packed, None)
    c = layer.wide.compact if avx2 else None
    return LinearDesc(
        w.data_ptr(), ptr(q), ptr(scale), ptr(bias), n, k, ptr(vn),
        *((q4.q.data_ptr(), q4.s.data_ptr(), q4.z.data_ptr()) if q4 is not None else (None,) * 3),
        *((c.blocks.data_ptr(), c.hb.data_ptr(), c.raw.data_ptr()) if c is not None else (None,) * 3),
        ptr(layer.wide.panels) if avx2 else None, ptr(vs),
    )  # fmt: skip


def screen_head(screen: Any) -> int | None:
    """A `vx_screen_head` for `screen` (a `ScreenedHead`, its scratch for one row), or None;
    kept on the screen, so it lives as long as the pointers in it."""
    if screen is None:
        return None
    desc = getattr(screen, "_c_desc", None)
    if desc is None:
        a, idx, cand = screen.row_scratch()
        # the candidates by the head's every-row GEMM on their packed rows (VNNI, AVX2 panels)
        packed = screen.exact_kernel() in ("vx_gemm_vnni_bf16", "vx_gemm_panels_avx2")
        desc = ScreenHeadDesc(
            screen.q.data_ptr(), screen.s.data_ptr(), screen.bound.ctypes.data,
            screen.weight.data_ptr(), a.data_ptr(), idx.data_ptr(), cand.data_ptr(),
            idx.shape[0], int(packed),
        )  # fmt: skip
        screen._c_desc = desc
    return ctypes.addressof(desc)


def model_family(model: Any) -> str | None:
    """The C step's block for a decoder stack of exactly these classes ("llama": the Llama,
    Qwen3 and Phi-3 layers; "gemma": Gemma 2's and 3's), else None (a family whose stack adds
    anything, experts, runs its module path)."""
    from vx.gpu.models.gemma import GemmaModel
    from vx.gpu.models.llama import LlamaModel

    return {LlamaModel: "llama", GemmaModel: "gemma"}.get(type(model))


def norm_modules(layer: Any) -> list[Any]:
    """The norm modules of a decoder layer (its q/k norms included)."""
    attn = layer.self_attn
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")  # fmt: skip
    mods = [getattr(layer, n) for n in names if hasattr(layer, n)]
    return mods + [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n]


def block_extras(layer: Any, family: str, paged: Any) -> tuple[tuple, tuple, tuple] | None:
    """What the C step needs of one decoder layer beyond its linears: (the two norms' weights
    it always reads, (q_norm, k_norm, attn_out_norm, mlp_out_norm) or Nones, (window,
    local_rope, softcap)), or None where the layer is not a block the C step implements
    exactly: the classes below, whose every op it mirrors (`vx/gpu/cpu/csrc/decode_step.c`)."""
    from vx.gpu.attention.windowed import WindowedAttention
    from vx.gpu.layers.linear import GemmaRMSNorm, RMSNorm
    from vx.gpu.models.gemma import GemmaAttention, GemmaDecoderLayer, GemmaMLP
    from vx.gpu.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from vx.gpu.models.mixtral import SparseMoeBlock
    from vx.gpu.models.phi3 import Phi3Attention
    from vx.gpu.models.qwen3 import Qwen3Attention

    attn, mlp = layer.self_attn, layer.mlp
    fn = attn.attn_fn
    window, softcap = 0, 0.0
    if type(fn) is WindowedAttention:
        window, softcap = fn.window or 0, fn.softcap or 0.0
    elif fn is not paged:
        return None
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    if family == "llama":
        if type(layer) is not LlamaDecoderLayer or type(mlp) not in (LlamaMLP, SparseMoeBlock):
            return None
        if type(attn) is Qwen3Attention:
            if (type(q_norm), type(k_norm)) != (RMSNorm, RMSNorm):
                return None
        elif type(attn) not in (LlamaAttention, Phi3Attention):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        qk = (q_norm, k_norm) if type(attn) is Qwen3Attention else (None, None)
        extra = (*(None if n is None else n.weight for n in qk), None, None)
        return (*norms, *(n for n in extra if n is not None)), extra, (window, 0, softcap)
    if (type(layer), type(attn), type(mlp)) != (GemmaDecoderLayer, GemmaAttention, GemmaMLP):
        return None
    if any(type(n) is not GemmaRMSNorm for n in norm_modules(layer)):
        return None
    norms = (layer.input_layernorm.weight, layer.pre_feedforward_layernorm.weight)
    extra = (
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
        layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight,
    )  # fmt: skip
    return (*norms, *(n for n in extra if n is not None)), extra, (
        window, attn.rope_index, softcap,
    )  # fmt: skip
