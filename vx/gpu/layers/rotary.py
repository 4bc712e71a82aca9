"""Rotary position embeddings (rotate-half / Neox style) and their inverse frequencies.

Runs in: each Worker process.

cos/sin are computed in fp32 and cast to the model dtype, exactly as HF's Llama does (see
`vx.gpu.layers.linear` for the numerics contract); on CUDA the rotation runs as a Triton kernel.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vx.gpu.layers import triton_ops

__all__ = [
    "RotaryEmbedding",
    "apply_rotary",
    "longrope_attention_factor",
    "rope_inv_freq",
    "rotary_dim",
]


def rotary_dim(head_dim: int, rope: dict) -> int:
    """How many leading dims of a head the rotary turns (all but with `partial_rotary_factor`)."""
    return int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))


def longrope_attention_factor(rope: dict) -> float:
    """LongRoPE's scale of cos and sin: given, or sqrt(1 + ln(factor) / ln(original length)),
    factor = max_position_embeddings / original_max_position_embeddings (HF's default)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or rope["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_inv_freq(head_dim: int, rope: dict, *, long: bool = False) -> torch.Tensor:
    """Inverse frequencies (fp32) for `rope` (HF's rope_parameters / rope_scaling dict).

    Supports "default", "linear", "llama3" (Llama 3.1's smoothed interpolation, the same
    arithmetic as HF's `_compute_llama3_parameters`) and "longrope" (Phi-3/4: the short factors
    here; `long=True` gives the long ones). A `partial_rotary_factor` < 1 gives the frequencies
    of the first `rotary_dim(head_dim, rope)` dims only.
    """
    base = float(rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    dim = rotary_dim(head_dim, rope)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "longrope":  # HF's _compute_longrope_parameters
        ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding from a cos/sin cache indexed by position.

    cos/sin are computed in fp32 for every position below `max_position` and stored in the
    model dtype ([max_position, head_dim // 2] each: the two halves of HF's `cat(freqs, freqs)`
    are equal), exactly the values HF computes per step and casts.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope: dict,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        #: the leading dims of a head that turn (the table is [max_position, rotary_dim // 2])
        self.rotary_dim = rotary_dim(head_dim, rope)
        positions = torch.arange(max_position, dtype=torch.int64).float()[:, None]
        freqs = positions * rope_inv_freq(head_dim, rope)[None, :]
        scale = 1.0
        if rope.get("rope_type") == "longrope":
            # HF switches to the long factors once a sequence is longer than the original
            # context: position p is rotated by them from p = original on. (HF also re-rotates
            # a whole prompt longer than that in one forward; vx turns each position once.)
            original = int(rope["original_max_position_embeddings"])
            long = positions * rope_inv_freq(head_dim, rope, long=True)[None, :]
            freqs = torch.where(positions >= original, long, freqs)
            scale = longrope_attention_factor(rope)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale  # fp32, then the model dtype (HF)
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim // 2] for `positions` [T]; done once per step, not per layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] -> rotated copy. The same elementwise ops as HF's rotate_half form:
    HF's x*cos + cat(-x2, x1)*sin has first half x1*c + (-x2)*s, bit for bit x1*c - x2*s.

    On CUDA the Triton kernel, and on CPU in bf16 the C one, rotate `x` IN PLACE (same
    roundings) and return it.
    """
    ops = triton_ops.for_tensor(x)
    if ops is not None and x.stride(-1) == 1 and x.shape[0]:
        t, h = x.shape[0], x.shape[1]
        c, s = cos.reshape(t, -1), sin.reshape(t, -1)
        # The kernel indexes cos/sin by position; these are already looked up: row i is i.
        ops.rotary_embedding(
            triton_ops.row_index(t, x.device), x[:, : h // 2], x[:, h // 2 :], c, s
        )
        return x
    if x.device.type == "cpu" and x.shape[0]:
        from vx.gpu.cpu.ops import fused_rotary

        if fused_rotary(x, cos, sin):  # in place, same roundings
            return x
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
