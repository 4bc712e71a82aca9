"""The model registry: HF `architectures[0]` name -> vx model class.

Runs in: each Worker process (and any process that only asks whether a name is supported:
`SUPPORTED_ARCHITECTURES` and `is_supported` import no torch).

Exact names only, no fuzzy matching: an unknown architecture is a clear error at load time.
"""

from __future__ import annotations

import importlib
from typing import Any

#: architecture name -> (module under vx.gpu.models, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    # text only: the vision tower is not loaded
    "Gemma3ForConditionalGeneration": ("gemma", "Gemma3ForConditionalGeneration"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTRY)


def is_supported(architecture: str) -> bool:
    return architecture in _REGISTRY


def get_model_class(architecture: str) -> Any:
    """The class for `architecture`; raises ValueError naming the supported ones."""
    try:
        module, cls = _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; vx supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
    return getattr(importlib.import_module(f"vx.gpu.models.{module}"), cls)
