"""Which fused Triton ops a tensor gets: `vx.gpu.attention.triton`'s RMSNorm and rotary kernels
for a CUDA tensor where triton is installed, else none (the layers' torch and C code).

Runs in: each Worker process. Its own module so that the layers and the rotary embedding both
ask it without importing each other (a test swaps `for_tensor` to run the Triton-path calls on
CPU with the references).
"""

from __future__ import annotations

import torch

__all__ = ["for_tensor", "row_index"]


def for_tensor(x: torch.Tensor):
    """`vx.gpu.attention.triton` when `x` is on a CUDA device and triton is there, else None:
    RMSNorm and rotary then run as its fused kernels (same rounding as the torch code)."""
    if not x.is_cuda:
        return None
    from vx.gpu.attention.paged import (
        triton as triton_attention,  # imports triton: only on the CUDA path
    )

    return triton_attention if triton_attention.HAS_TRITON else None


_ROW_INDEX: dict[torch.device, torch.Tensor] = {}


def row_index(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) on `device`, cached (never grown inside a CUDA graph capture)."""
    idx = _ROW_INDEX.get(device)
    if idx is None or idx.shape[0] < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(n, device=device)
        idx = _ROW_INDEX[device] = torch.arange(max(n, 8192), device=device)
    return idx[:n]
