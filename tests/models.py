"""Tiny random HF model directories for tests (Llama, Qwen2, Mistral), built offline.

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

_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
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
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    return config_cls(**kwargs)


def make_tiny_model(tmp_path: Any, arch: str = "llama", *, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random `arch` model + tokenizer under tmp_path/<arch>-<seed>; return the dir.

    `overrides` go to the transformers config (e.g. `tie_word_embeddings=True`,
    `rope_parameters={...}`, `num_hidden_layers=3`).
    """
    import torch
    import transformers

    path = os.path.join(str(tmp_path), f"tiny-{arch}-{seed}")
    tokenizer = make_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    model_cls = getattr(transformers, _ARCHS[arch][1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
