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
import struct
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


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_header(f: Any) -> tuple[dict, int]:
    """A safetensors header: 8-byte little-endian length, then JSON; data follows it."""
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one file in storage order, each read into fresh memory.

    NOTE: plain reads rather than safetensors' mmap: pages of a mapping stay resident (and
    count in RSS) until the whole file is closed, which would put peak memory at model plus
    file; read() leaves them in the page cache only.
    """
    with open(file, "rb") as f:
        header, base = _read_header(f)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
            buf = t.view(-1).view(torch.uint8).numpy()
            if buf.nbytes != end - begin:
                raise ValueError(f"{file}: {name} has {end - begin} bytes, expected {buf.nbytes}")
            f.seek(base + begin)
            if f.readinto(buf) != buf.nbytes:
                raise ValueError(f"{file}: truncated at {name}")
            yield name, t


def iterate_weights(path: str, *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor of every safetensors file, one at a time."""
    from tqdm import tqdm

    files = _safetensors_files(path)
    total = 0
    for file in files:  # headers only: cheap
        with open(file, "rb") as f:
            total += len(_read_header(f)[0])
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    try:
        for file in files:
            for item in _read_safetensors(file):
                yield item
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
    pp_rank: int = 0,
    pp_size: int = 1,
    progress: bool = True,
    quantization: str | None = None,
) -> torch.nn.Module:
    """Build the model named by `path`/config.json and fill it from its safetensors files.

    `quantization` ("int8" / "int4", CPU only) adds weight-only quantized copies of the linears
    and the LM head after loading (vx.gpu.layers.quantization); None leaves the model as it was.
    With `pp_size > 1` only pipeline stage `pp_rank`'s modules are built and read.
    """
    from transformers import AutoConfig

    from vx.gpu.layers.quantization import validate_quantization

    hf_config = AutoConfig.from_pretrained(path)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{path}/config.json names no architecture")
    cls = get_model_class(architectures[0])
    device = torch.device(device)
    validate_quantization(quantization, device)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    logger.info(
        "loading %s (%s) as %s%s on %s, tp %d/%d, pp %d/%d",
        os.path.basename(os.path.normpath(path)),
        architectures[0],
        str(torch_dtype).removeprefix("torch."),
        f" + weight-only {quantization}" if quantization else "",
        device,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
    )
    with torch.no_grad():
        qkw: dict[str, Any] = {"quantization": quantization} if quantization else {}
        if pp_size > 1:
            qkw.update(pp_rank=pp_rank, pp_size=pp_size)
        model = cls(
            hf_config, dtype=torch_dtype, device=device, tp_rank=tp_rank, tp_size=tp_size, **qkw
        )
        model.load_weights(iterate_weights(path, progress=progress))
        for module in model.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
    return model.eval()
