"""Tiny random HF model directories for tests (Llama, Qwen2, Mistral, Qwen3, Mixtral,
Qwen3-MoE), built offline.

Runs in: the test process.

`make_tiny_model(tmp_path, arch="llama")` writes config.json, model.safetensors (through
`save_pretrained`), generation_config.json and a byte-level BPE tokenizer with a ChatML chat
template, trained on a few sentences with the `tokenizers` library, so nothing is downloaded.
The same seed gives the same weights. Building one takes well under a second.
"""

from __future__ import annotations

import functools
import os
from typing import Any

TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for vx tests.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Once upon a time there was a small language model that loved numbers: 0 1 2 3 4 5 6 7 8 9.",
    "Continuous batching keeps every slot busy; prefill and decode share one step.",
    "What is the capital of France? Paris is the capital of France.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Overrides for a tiny Llama that a test serves on vx's default path (no `--dtype`: `auto`):
#: a bf16 checkpoint, which `auto` keeps in bf16 on CPU as it keeps SmolLM2's (an fp32 one stays
#: fp32, which the fused CPU step and the LM head's C argmax do not take), and a head size of
#: 32, the least the fused step's C prefill attention takes (vx/gpu/cpu/fused_step.py: at the
#: default 16, prompt and mixed steps decline it). The linears' shapes (N % 16, K % 32) already
#: suit its GEMMs. tests/e2e/test_serve.py checks that a served greedy request takes it.
SERVED: dict[str, Any] = {"dtype": "bfloat16", "head_dim": 32}

_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
#: per-family fields tiny_config sets beside the shared ones (Qwen3's default head_dim is 128;
#: the MoE families get 8 experts, top-2, as issue 50 asks of their parity tests)
_FAMILY: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "phi3": {"sliding_window": None},
    # a window of 8 keys (shorter than the test prompts), sliding then global layers, and
    # soft-caps low enough to bend the random logits
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 10.0,
    },
    "gemma3": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    },
    "qwen3": {"head_dim": 16},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    # clip_qkv low enough that the random projections' outliers are clamped
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "clip_qkv": 2.0},
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
}


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 384) -> Any:
    """A PreTrainedTokenizerFast: bos <|im_start|>, eos <|im_end|>, ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(arch: str = "llama", vocab_size: int = 384, **overrides: Any) -> Any:
    """A transformers config for a 2-layer, hidden-64, 4-head (2 KV heads) model."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}")
    config_cls = getattr(transformers, _ARCHS[arch][0])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        # Wider than HF's 0.02 so random logits have clear winners: greedy parity tests then
        # don't hinge on fp32 rounding between near-equal logits.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=[_ARCHS[arch][1]],
        dtype="float32",
    )
    kwargs.update(_FAMILY.get(arch, {}))
    kwargs.update(overrides)
    return config_cls(**kwargs)


def make_tiny_model(tmp_path: Any, arch: str = "llama", *, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random `arch` model + tokenizer under tmp_path/<arch>-<seed>; return the dir.

    `overrides` go to the transformers config (e.g. `tie_word_embeddings=True`,
    `rope_parameters={...}`, `num_hidden_layers=3`); with `dtype="bfloat16"` (as in `SERVED`)
    the weights are saved in bf16 (rounded from the same fp32 draw).
    """
    import torch
    import transformers

    path = os.path.join(str(tmp_path), f"tiny-{arch}-{seed}")
    tokenizer = make_tokenizer()
    overrides.setdefault("vocab_size", len(tokenizer))  # may exceed the tokenizer's (padding)
    config = tiny_config(arch, **overrides)
    model_cls = getattr(transformers, _ARCHS[arch][1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    dtype = config.dtype if not isinstance(config.dtype, str) else getattr(torch, config.dtype)
    if dtype in (torch.bfloat16, torch.float16):  # else save_pretrained writes fp32
        model = model.to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# HF tensor name -> GGUF name (llama.cpp's convert_hf_to_gguf naming)
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
#: an HF expert tensor's part -> the GGUF tensor that stacks it over the experts
_GGUF_EXPERTS = {
    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
}  # fmt: skip
#: per GGUF architecture, HF names that map elsewhere than `_GGUF_NAMES` says
_GGUF_ARCH_NAMES = {
    "gemma": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_GGUF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",  # llama.cpp's Mixtral is llama with experts
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF name; for an expert's tensor, the stacked tensor's name and `#<expert>`."""
    base, _, kind = hf_name.rpartition(".")
    parts = base.split(".")
    if "experts" in parts:  # model.layers.N.<mlp>.experts.E.<part>
        return f"blk.{parts[2]}.{_GGUF_EXPERTS[parts[-1]]}.{kind}#{parts[-2]}"
    if base in _GGUF_NAMES:
        return f"{_GGUF_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.<rest>
    names = {**_GGUF_NAMES, **_GGUF_ARCH_NAMES.get("gemma" if "gemma" in arch else arch, {})}
    return f"blk.{layer}.{names[rest]}.{kind}"


def make_tiny_gguf(hf_dir: str, gguf_path: str, *, qtype: str = "F32") -> str:
    """Write the model in `hf_dir` (llama, qwen2, qwen3, qwen3moe, Mixtral as llama with
    experts, gemma2, gemma3, phi3) as a GGUF, as llama.cpp's convert_hf_to_gguf: experts
    stacked [E, ...], Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors.

    For llama, q_proj/k_proj rows are permuted the way llama.cpp does for its rope and llama3
    rope scaling becomes a `rope_freqs` tensor; 2-D weights are stored as `qtype` (F32, F16,
    BF16, Q8_0, Q4_1...), norms and biases as F32. The tokenizer (byte-level BPE) and chat
    template go into the `tokenizer.*` metadata.
    """
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from vx.gpu.layers.linear import rope_inv_freq
    from vx.models_hub.gguf_convert import permute_qk

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    arch = _GGUF_ARCHS[cfg["architectures"][0]]
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(gguf_path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (llama.cpp's base)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors are tensors
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for which in ("long", "short"):
            factors = np.array(rope[f"{which}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{which}.weight", factors)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_file_type({"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 7, "BF16": 32}.get(qtype, 7))

    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = CONTROL
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    if rope.get("rope_type") == "llama3":  # llama.cpp stores the per-dim divisors
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        base = rope_inv_freq(head_dim, {"rope_theta": rope["rope_theta"]})
        w.add_tensor("rope_freqs.weight", (base / rope_inv_freq(head_dim, rope)).numpy())
    out: dict[str, np.ndarray] = {}
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name in sorted(tensors):
        a = tensors[name].astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = permute_qk(a, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            a = permute_qk(a, cfg["num_key_value_heads"])
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's Gemma norms multiply by the weight alone
        gguf_name, _, expert = _gguf_name(name, arch).partition("#")
        if expert:
            stacked.setdefault(gguf_name, {})[int(expert)] = a
        else:
            out[gguf_name] = a
    for gguf_name, parts in stacked.items():
        out[gguf_name] = np.stack([parts[e] for e in range(len(parts))])
    for gguf_name in sorted(out):
        a = out[gguf_name]
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.ascontiguousarray(a))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_path
