"""Load an HF model directory into a vx model, one tensor at a time.

Runs in: each Worker process.

The model is built with empty parameters (no random init) directly on the target device, then
each safetensors tensor is read, cut to this rank's shard and copied (with dtype conversion)
into its parameter before the next one is read, so peak host memory stays near one model copy
plus the largest tensor, not two copies.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from vx.gpu.models import get_model_class

logger = logging.getLogger(__name__)

__all__ = ["iterate_weights", "load_model", "resolve_dtype"]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    """The checkpoint dtype named by config.json (`dtype` in transformers 5, `torch_dtype` before)."""
    for attr in ("dtype", "torch_dtype"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
            return _DTYPES[value.removeprefix("torch.")]
    return None


def resolve_dtype(
    dtype: str | torch.dtype, hf_config: Any, device: torch.device | str
) -> torch.dtype:
    """`auto` -> the config's dtype; on CPU, bfloat16 for a 16-bit checkpoint, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}") from None
    config_dtype = _config_dtype(hf_config) or torch.float32
    if torch.device(device).type == "cpu":
        return torch.bfloat16 if config_dtype in (torch.bfloat16, torch.float16) else torch.float32
    return config_dtype


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path!r} (vx loads safetensors only, never pickled .bin files)"
        )
    return files


def iterate_weights(path: str, *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor of every safetensors file, one at a time."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = _safetensors_files(path)
    total = 0
    for file in files:  # headers only: cheap
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    try:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)
    finally:
        bar.close()


def load_model(
    path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    progress: bool = True,
) -> torch.nn.Module:
    """Build the model named by `path`/config.json and fill it from its safetensors files."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{path}/config.json names no architecture")
    cls = get_model_class(architectures[0])
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    logger.info(
        "loading %s (%s) as %s on %s, tp %d/%d",
        os.path.basename(os.path.normpath(path)),
        architectures[0],
        str(torch_dtype).removeprefix("torch."),
        device,
        tp_rank,
        tp_size,
    )
    with torch.no_grad():
        model = cls(hf_config, dtype=torch_dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
        model.load_weights(iterate_weights(path, progress=progress))
        for module in model.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
    return model.eval()
