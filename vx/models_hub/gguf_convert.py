"""Convert a llama.cpp GGUF file into an HF model directory (safetensors + tokenizer + config).

Runs in: the ApiServer (launcher) process, once per GGUF file, called by `vx.models_hub.resolve`;
torch, numpy, gguf and transformers are imported only inside `convert_gguf`.

What it undoes: llama.cpp's `convert_hf_to_gguf` permutes the rows of q_proj/k_proj for its
interleaved rope (per head: [h0, h1, ..., h(d/2), ...] -> pairs (h_i, h_(i+d/2)) adjacent);
`_unpermute` inverts that so the HF rotate-half rope applies. Quantised tensors are
dequantised with `gguf.quants.dequantize` and stored per tensor in the smallest dtype that
holds the values exactly: bfloat16 when every value is a bf16 number (norm weights stored as
F32/BF16), float32 otherwise (Q4_1/Q8_0 dequantise to fp16 scale x int + fp16 min, which
bf16 cannot represent). config.json names bfloat16 as the serving dtype for 16-bit and
quantised files, so `--dtype auto` serves them in bf16.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CONVERTER_VERSION", "convert_gguf"]

#: Bump when the output format changes: resolve.py keys its cache on it.
CONVERTER_VERSION = 1

#: Shard the safetensors output at about this many bytes.
_SHARD_BYTES = 2 * 1024**3

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
#: per GGUF architecture, names that differ from `_BLOCK`'s: Gemma's four norms a layer
#: (llama.cpp's `ffn_norm` is Gemma's pre-feedforward norm), Phi-3's fused projections
_ARCH_BLOCK = {
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_BLOCK["gemma3"] = _ARCH_BLOCK["gemma2"]
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
#: llama.cpp stores Gemma's norm weights as 1 + w (its norm multiplies by the weight alone)
_NORM_PLUS_ONE = ("gemma2", "gemma3")
#: llama with `llama.expert_count` is llama.cpp's Mixtral
_LLAMA_MOE = ("MixtralConfig", "MixtralForCausalLM")
#: GGUF's stacked experts [E, ...] -> each expert's HF tensor, per HF family: (router, {GGUF
#: name: HF name with {e} for the expert})
_EXPERTS = {
    "MixtralForCausalLM": ("block_sparse_moe.gate", {
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    }),
    "Qwen3MoeForCausalLM": ("mlp.gate", {
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
    }),
}  # fmt: skip
# GGUF general.file_type: 0 = ALL_F32, 1 = MOSTLY_F16; everything else serves as bf16.
_FILE_TYPE_DTYPE = {0: "float32", 1: "float16"}


def hf_tensor_name(
    gguf_name: str, architecture: str = "LlamaForCausalLM", arch: str = "llama"
) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None to skip.

    A stacked expert tensor (`blk.3.ffn_gate_exps.weight`) gives a name with `{e}` where the
    expert's index goes; `architecture` is the HF class it converts to, `arch` the GGUF one.
    """
    if gguf_name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        return None  # folded into config.json's rope parameters
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        router, experts = _EXPERTS.get(architecture, ("", {}))
        hf = _ARCH_BLOCK.get(arch, {}).get(parts[2]) or _BLOCK.get(parts[2])
        hf = hf or experts.get(parts[2])
        if parts[2] == "ffn_gate_inp" and router:
            hf = router
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def permute_qk(w: Any, num_heads: int) -> Any:
    """What llama.cpp does to HF q/k rows (numpy or torch); `_unpermute` is its inverse."""
    rest = tuple(w.shape[1:])
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    )


def _unpermute(w: Any, num_heads: int) -> Any:
    rest = tuple(w.shape[1:])
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
    )


class _Meta:
    """GGUF key/value metadata, decoded lazily (token arrays are large)."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def get_float(self, key: str, default: float) -> float:
        """A float32 value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
        import numpy as np

        return float(str(np.float32(self.get(key, default))))

    def __contains__(self, key: str) -> bool:
        return key in self._fields


def _rope_parameters(meta: _Meta, arch: str, head_dim: int, rope_freqs: Any) -> dict:
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": meta.get_float(f"{arch}.rope.freq_base", 10000.0),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=meta.get_float(f"{arch}.rope.scaling.factor", 1.0))
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported")
    if rope_freqs is not None:
        rope.update(_llama3_from_rope_freqs(rope["rope_theta"], head_dim, rope_freqs))
    return rope


def _llama3_from_rope_freqs(theta: float, head_dim: int, rope_freqs: Any) -> dict:
    """Recover HF's llama3 rope parameters from llama.cpp's `rope_freqs` (1 / per-dim factor).

    The GGUF stores only the resulting factors, so try the parameter sets Meta shipped
    (Llama 3.1: factor 8, Llama 3.2: factor 32; low 1, high 4, original context 8192) and keep
    the one that reproduces them.
    """
    import torch

    from vx.gpu.layers.linear import rope_inv_freq

    base = rope_inv_freq(head_dim, {"rope_theta": theta})
    want = torch.tensor(rope_freqs, dtype=torch.float32).flatten()  # a copy: mmap is read-only
    for factor in (8.0, 32.0, 16.0, 4.0):
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        got = base / rope_inv_freq(head_dim, {"rope_theta": theta, **params})
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4):
            return params
    raise NotImplementedError("GGUF rope_freqs matches no known llama3 rope scaling")


def _build_config(
    meta: _Meta,
    arch: str,
    shapes: dict[str, tuple[int, ...]],
    rope_freqs: Any,
    rope_tensors: dict[str, Any] | None = None,
) -> Any:
    import transformers

    p = f"{arch}."
    hidden = int(meta.get(p + "embedding_length"))
    num_heads = int(meta.get(p + "attention.head_count"))
    num_kv_heads = int(meta.get(p + "attention.head_count_kv", num_heads))
    head_dim = int(meta.get(p + "attention.key_length", hidden // num_heads))
    bos, eos, pad = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    experts = int(meta.get(p + "expert_count", 0) or 0)
    names = _LLAMA_MOE if arch == "llama" and experts else _ARCHS[arch]
    config_cls = getattr(transformers, names[0])
    kwargs: dict[str, Any] = dict(
        architectures=[names[1]],
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(meta.get(p + "feed_forward_length", 0) or 0),
        num_hidden_layers=int(meta.get(p + "block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        rms_norm_eps=meta.get_float(p + "attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        pad_token_id=None if pad is None else int(pad),
        dtype=_FILE_TYPE_DTYPE.get(meta.get("general.file_type"), "bfloat16"),
    )
    if head_dim != hidden // num_heads or arch.startswith("qwen3"):  # Qwen3's default is 128
        kwargs["head_dim"] = head_dim
    if experts:
        kwargs["num_experts_per_tok"] = int(meta.get(p + "expert_used_count"))
        if arch == "llama":
            kwargs["num_local_experts"] = experts
        else:  # qwen3moe; llama.cpp renormalises its top-k unless told otherwise
            kwargs["num_experts"] = experts
            kwargs["moe_intermediate_size"] = int(meta.get(p + "expert_feed_forward_length"))
            kwargs["norm_topk_prob"] = bool(meta.get(p + "expert_weights_norm", True))
            kwargs["intermediate_size"] = int(meta.get(p + "feed_forward_length", 0) or 0)
    rope = _rope_parameters(meta, arch, head_dim, rope_freqs)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:  # transformers 4.x: theta and scaling are separate fields
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if arch in ("gemma2", "gemma3"):
        _gemma_config(meta, arch, kwargs, transformers)
    if arch == "phi3":
        _phi3_config(meta, kwargs, head_dim, rope_tensors or {})
    return config_cls(**kwargs)


def _gemma_config(meta: _Meta, arch: str, kwargs: dict[str, Any], transformers: Any) -> None:
    """Gemma's fields llama.cpp keeps, or derives as llama.cpp does: the attention scale is
    1/sqrt(head_dim) except on the 27B models (1/sqrt(hidden / heads)); the layer pattern is
    the HF config's default (Gemma 2: alternate; Gemma 3: every 6th layer global), which is
    llama.cpp's; Gemma 3's sliding layers turn with base 10 000, as llama.cpp hard-codes."""
    p = f"{arch}."
    kwargs["head_dim"] = int(meta.get(p + "attention.key_length"))
    kwargs["sliding_window"] = int(meta.get(p + "attention.sliding_window", 4096))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        kwargs[key] = meta.get_float(p + key, 0.0) or None
    big = kwargs["num_hidden_layers"] in (46, 62)  # Gemma 2 27B, Gemma 3 27B
    heads = kwargs["num_attention_heads"]
    kwargs["query_pre_attn_scalar"] = kwargs["hidden_size"] // heads if big else kwargs["head_dim"]
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": 10000.0}
        if "rope_parameters" in kwargs:
            full = kwargs.pop("rope_parameters")
            kwargs["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        else:  # transformers 4.x
            kwargs["rope_local_base_freq"] = local["rope_theta"]


def _decimals(a: Any) -> list[float]:
    """float32 values as their shortest decimals (1.1, not 1.100000023841858), as HF wrote them."""
    import numpy as np

    return [float(str(np.float32(x))) for x in np.asarray(a).flatten()]


def _phi3_config(
    meta: _Meta, kwargs: dict[str, Any], head_dim: int, rope_tensors: dict[str, Any]
) -> None:
    """Phi-3's partial rotary (rope.dimension_count), sliding window and LongRoPE (the
    `rope_factors_long/short` tensors and the original context length)."""
    rope = kwargs.get("rope_parameters")
    if rope is None:
        raise NotImplementedError("Phi-3 GGUF needs transformers >= 5")
    dims = int(meta.get("phi3.rope.dimension_count", head_dim))
    rope["partial_rotary_factor"] = dims / head_dim
    window = meta.get("phi3.attention.sliding_window")
    kwargs["sliding_window"] = None if window is None else int(window)
    if "rope_factors_long.weight" in rope_tensors:
        original = int(meta.get("phi3.rope.scaling.original_context_length"))
        rope.update(
            rope_type="longrope",
            long_factor=_decimals(rope_tensors["rope_factors_long.weight"]),
            short_factor=_decimals(rope_tensors["rope_factors_short.weight"]),
            original_max_position_embeddings=original,
        )
        kwargs["original_max_position_embeddings"] = original
        if "phi3.rope.scaling.attn_factor" in meta:
            rope["attention_factor"] = meta.get_float("phi3.rope.scaling.attn_factor", 1.0)


def _save_tokenizer(gguf_path: str, meta: _Meta, out_dir: str) -> None:
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template  # keep it even if this transformers drops it
    tokenizer.save_pretrained(out_dir)


class _ShardWriter:
    """Writes tensors to ~2 GiB safetensors shards as they come, so conversion memory stays
    near one shard; renamed at the end to HF's `model-0000i-of-0000N` (or `model.safetensors`).
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.pending: dict[str, Any] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str], int]] = []  # (temp file, names, bytes)

    def add(self, name: str, t: Any) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > _SHARD_BYTES:
            self._flush()
        self.pending[name] = t
        self.pending_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = os.path.join(self.out_dir, f"shard-{len(self.files)}.tmp")
        save_file(self.pending, file, metadata={"format": "pt"})
        self.files.append((file, list(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            os.rename(self.files[0][0], os.path.join(self.out_dir, "model.safetensors"))
            return
        weight_map, total = {}, 0
        for i, (tmp, names, nbytes) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(tmp, os.path.join(self.out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
            total += nbytes
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def convert_gguf(gguf_path: str, out_dir: str, *, progress: bool = True) -> dict[str, str]:
    """Write config.json, generation_config.json, safetensors and tokenizer files to `out_dir`.

    Returns {HF tensor name: stored dtype} (bfloat16 where exact, else float32).
    """
    import gguf
    import numpy as np
    import torch
    from tqdm import tqdm

    reader = gguf.GGUFReader(gguf_path)
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (vx converts {', '.join(_ARCHS)})"
        )
    # GGUF shapes are ggml order (fastest dim first); numpy/HF order is reversed.
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = None
    if "rope_freqs.weight" in by_name:
        t = by_name["rope_freqs.weight"]
        rope_freqs = gguf.quants.dequantize(t.data, t.tensor_type)
    rope_tensors = {
        name: gguf.quants.dequantize(by_name[name].data, by_name[name].tensor_type)
        for name in ("rope_factors_long.weight", "rope_factors_short.weight")
        if name in by_name
    }
    config = _build_config(meta, arch, shapes, rope_freqs, rope_tensors)
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads

    os.makedirs(out_dir, exist_ok=True)
    writer = _ShardWriter(out_dir)
    dtypes: dict[str, str] = {}
    bar = tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", disable=not progress)
    for t in bar:
        name = hf_tensor_name(t.name, config.architectures[0], arch)
        if name is None:
            continue
        a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shapes[t.name])
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            a = a - 1.0
        if arch == "llama" and ".q_proj." in name:
            a = _unpermute(a, num_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _unpermute(a, num_kv_heads)
        # A stacked expert tensor [E, ...] becomes one HF tensor per expert.
        parts = (
            [(name.format(e=e), a[e]) for e in range(a.shape[0])] if "{e}" in name else [(name, a)]
        )
        for hf_name, part in parts:
            x = torch.from_numpy(np.array(part, dtype=np.float32, order="C"))  # owns its memory
            b = x.to(torch.bfloat16)
            x = b if torch.equal(b.float(), x) else x
            writer.add(hf_name, x)
            dtypes[hf_name] = str(x.dtype).removeprefix("torch.")
    bar.close()
    writer.close()

    config.save_pretrained(out_dir)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
    _save_tokenizer(gguf_path, meta, out_dir)
    counts = {d: sum(1 for v in dtypes.values() if v == d) for d in set(dtypes.values())}
    logger.info("converted %s: %s tensors by stored dtype", os.path.basename(gguf_path), counts)
    return dtypes
