"""The compact copy of a bf16 weight (`vx.gpu.cpu.compact`): its layout against a decoder
written from the layout's description, here in Python.

Runs in: the test process (no kernel library: the kernel's own bits are checked against the
bf16 skinny GEMM in `tests/gpu/cpu/test_kernel_targets.py` and `tests/gpu/cpu/test_widen.py`).
"""

from __future__ import annotations

import pytest
import torch

from vx.gpu.cpu import compact as cpu_compact
from vx.gpu.cpu.compact import pack_compact


def _decode(blocks: torch.Tensor, hb: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 bits (int32) from the layout as `vx/gpu/cpu/csrc/gemv_compact_avx2.c` states it."""
    n, nb, _ = blocks.shape
    out = torch.empty(n, nb * 32, dtype=torch.int32)
    raw_bits = raw.view(torch.int16).to(torch.int32) & 0xFFFF
    for r in range(n):
        for b in range(nb):
            blk = blocks[r, b].tolist()
            h = int(hb[r, b])
            if h == 0xFF:
                idx = int.from_bytes(bytes(blk[32:36]), "little")
                out[r, 32 * b : 32 * b + 32] = raw_bits[idx]
                continue
            for j in range(32):
                col = 8 * ((j & 15) >> 2) + (j & 3) + 4 * (j >> 4)
                code = (blk[32 + (j & 15)] >> (4 * (j >> 4))) & 0xF
                high = ((code & 8) << 4) | (h - (code & 7))
                out[r, 32 * b + col] = (high << 8) | blk[j]
    return out


def test_every_value_decodes_to_its_own_bits() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 96, generator=g) * 0.05).bfloat16()
    w[0, :40] = torch.randn(40, generator=g).bfloat16() * 2.0 ** torch.arange(-20, 20)  # spread
    w[1, 3] = -0.0
    w[1, 4:10] = 0.0
    w[2, 7] = float("nan")
    w[2, 70] = float("-inf")
    w[3, 9] = 1e-40  # subnormal
    w[4] = torch.tensor(0x1234, dtype=torch.int16).view(torch.bfloat16)  # the same all along
    blocks, hb, raw = pack_compact(w)
    assert blocks.shape == (6, 3, 48) and blocks.dtype is torch.uint8
    assert hb.shape == (6, 3) and raw.dtype is torch.bfloat16
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(_decode(blocks, hb, raw), bits)
    # blocks with a zero or far smaller values beside large ones are raw; the rest are not
    raw_blocks = {(r, b) for r, b in (hb == 0xFF).nonzero().tolist()}
    assert {(0, 0), (0, 1), (1, 0), (3, 0)} <= raw_blocks
    assert (4, 0) not in raw_blocks and (5, 2) not in raw_blocks


def test_trained_like_weights_are_mostly_compact() -> None:
    """Gaussian weights (as trained matrices' blocks mostly are): few raw blocks, 12.25 bits a
    value with the block bytes."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 576, generator=g) * 0.02).bfloat16()
    blocks, hb, raw = pack_compact(w)
    assert (hb == 0xFF).float().mean() < 0.05
    assert (blocks.numel() + hb.numel()) * 8 / w.numel() == 12.25
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(_decode(blocks[:4], hb[:4], raw), bits[:4])


def test_slices_of_rows_number_their_raw_blocks_in_order(monkeypatch) -> None:
    """Packed a few rows at a time, the raw blocks' indices still count across the slices."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(7, 64, generator=g) * 0.05).bfloat16()
    w[[0, 2, 3, 6], [1, 40, 5, 63]] = 0.0
    monkeypatch.setattr(cpu_compact, "_SLICE_VALUES", 128)  # two rows a slice
    blocks, hb, raw = pack_compact(w)
    assert raw.shape[0] == 4 and (hb == 0xFF).sum() == 4
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(_decode(blocks, hb, raw), bits)


def test_shapes_it_does_not_take_are_refused() -> None:
    with pytest.raises(ValueError, match="K % 32"):
        pack_compact(torch.zeros(4, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        pack_compact(torch.zeros(4, 64))
