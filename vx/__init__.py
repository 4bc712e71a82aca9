"""vx: a serving engine for large language models on the vLLM V1 architecture.

This module imports no torch, so the ApiServer process stays light.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):  # lazy: `import vx` must stay cheap
    if name == "SamplingParams":
        from vx.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from vx.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "LLM":
        from vx.llm import LLM

        return LLM
    raise AttributeError(name)
