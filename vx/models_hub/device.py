"""Per-hardware, per-entry-point defaults: what the device has, and what vx asks of it.

Runs in: the launcher (the front process of `vx serve`, or the user's process for `vx.LLM`),
before any Worker starts. Imports no torch at module level, and none at all on CPU.

vLLM's defaults depend on the device and on the entry point: on a CUDA device the server's
token budget is 8,192 under 160 GiB of device memory and 16,384 at or above (an H200's 141 GB
is 131 GiB: 8,192), the offline `LLM` class gets twice the server's, and `max_num_seqs` is
1,024 on a GPU (256 on CPU, where a step of 1,024 sequences would take seconds).

Device memory is read through NVML (the driver's management library, via ctypes) so that the
front process never creates a CUDA context: a context there would hold several hundred MiB of
the GPU that the Worker sizes its KV pool from. Without NVML, a short child process asks
`torch.cuda.get_device_properties`.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys

from vx import envs
from vx.config import default_max_num_batched_tokens

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_MAX_NUM_SEQS",
    "GPU_MAX_NUM_SEQS",
    "default_max_num_seqs",
    "device_total_memory",
    "resolve_scheduler_defaults",
]

CPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_SEQS = 1024


class _NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def _first_visible_index() -> int:
    """NVML index of the first device CUDA shows (CUDA_VISIBLE_DEVICES given as indices)."""
    visible = envs.CUDA_VISIBLE_DEVICES.split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def _nvml_total_memory(index: int) -> int | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle = ctypes.c_void_p()
    mem = _NvmlMemory()
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            return None
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.total) or None
    finally:
        lib.nvmlShutdown()


_TORCH_QUERY = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"


def _torch_total_memory() -> int | None:
    """Ask torch in a child process (so this process gets no CUDA context)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _TORCH_QUERY], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not query the CUDA device: %s", e)
        return None
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out or not out[-1].isdigit():
        logger.warning("could not query the CUDA device: %s", proc.stderr.strip()[-300:])
        return None
    return int(out[-1])


def device_total_memory(device: str) -> int | None:
    """Bytes of memory of the first visible `device` ("cuda"), or None on CPU or if unknown."""
    if device != "cuda":
        return None
    total = _nvml_total_memory(_first_visible_index())
    if total is None:
        total = _torch_total_memory()
    return total


def default_max_num_seqs(device: str) -> int:
    return GPU_MAX_NUM_SEQS if device == "cuda" else CPU_MAX_NUM_SEQS


def resolve_scheduler_defaults(
    device: str,
    *,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    offline: bool,
    device_memory_bytes: int | None = None,
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the given values, or this hardware's and this
    entry point's defaults. The device is queried only when a default needs its memory."""
    seqs = max_num_seqs or default_max_num_seqs(device)
    budget = max_num_batched_tokens
    if not budget:
        if device_memory_bytes is None and device == "cuda":
            device_memory_bytes = device_total_memory(device)
        budget = default_max_num_batched_tokens(device_memory_bytes, offline=offline, device=device)
        if device == "cuda":
            logger.info(
                "default max_num_batched_tokens %d (%s, %s GiB device)",
                budget, "offline" if offline else "server",
                "?" if device_memory_bytes is None else f"{device_memory_bytes / 2**30:.0f}",
            )  # fmt: skip
    return seqs, budget
