"""The Triton fused-MoE kernel: the experts of a step as two grouped GEMMs on the GPU.

Runs in: each Worker process (CUDA devices). Importable without CUDA and without triton (the
kernel is then missing and `fused_experts` raises); tests/gpu/test_triton.py runs it on CPU
tensors under ``TRITON_INTERPRET=1`` against `vx.gpu.layers.fused_moe.moe_reference`.

As vLLM's `fused_moe`: `align` sorts the step's (token, slot) pairs by expert and pads each
expert's run to a multiple of `BLOCK_M` (with a sentinel id), all in torch ops on the device
with no host read (the padded length is bounded: pairs + E (BLOCK_M - 1)); then one program
per (block of BLOCK_M pairs of one expert, BLOCK_N output columns) multiplies the pairs' rows
by that expert's weight. The first GEMM reads token rows (pair // top_k) against `w13`; the
SiLU-and-mul runs in torch; the second reads pair rows against `w2` and multiplies each row
by its routing weight in fp32 before the store; the k slots of a token are summed in torch.

NOTE: under the interpreter `tl.dot` takes fp32 operands (numpy has no bf16), as in
`vx.gpu.attention.triton`.
"""

from __future__ import annotations

import torch

from vx import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships on linux x86_64 only
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "align", "fused_experts"]

#: see `vx.gpu.attention.triton._INTERPRETING`
_INTERPRETING: bool = envs.TRITON_INTERPRET
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [cap], each block's expert [cap // block_m]) for ids [T, k].

    Pairs p = t * k + slot, grouped by expert, each expert's run padded to a multiple of
    `block_m` with the sentinel T * k; cap = the bound on the padded length, so no value is
    read back to the host. Blocks past the last expert's run hold sentinels only.
    """
    flat = ids.reshape(-1)
    pairs = flat.numel()
    cap = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=ids.device) - first_of_expert[expert_of]
    sorted_ids = torch.full((cap,), pairs, dtype=torch.int64, device=ids.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order
    block_start = torch.arange(0, cap, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert


if HAS_TRITON:

    @triton.jit
    def _grouped_gemm(
        a_ptr, b_ptr, c_ptr, w_ptr, ids_ptr, expert_ptr,
        num_pairs, n, k,
        stride_am, stride_be, stride_bn, stride_cm,
        TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pair = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = pair < num_pairs
        row = pair // TOP_K
        expert = tl.load(expert_ptr + pid_m)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + row[:, None] * stride_am + ks[None, :],
                mask=live[:, None] & (ks[None, :] < k), other=0.0,
            )  # fmt: skip
            b = tl.load(
                b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0,
            )  # fmt: skip
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                acc += tl.dot(a, b)
        if WEIGHTED:
            acc = acc * tl.load(w_ptr + pair, mask=live, other=0.0).to(tl.float32)[:, None]
        tl.store(
            c_ptr + pair[:, None] * stride_cm + cols[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=live[:, None] & (cols[None, :] < n),
        )


def _gemm(a, b, c, weights, sorted_ids, block_expert, num_pairs, top_k, weighted) -> None:
    e, n, k = b.shape
    grid = (block_expert.shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_gemm[grid](
        a, b, c, weights, sorted_ids, block_expert, num_pairs, n, k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, WEIGHTED=weighted, DOT_FP32=_INTERPRETING,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`moe_reference`'s contract (x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights, ids
    [T, k]) -> [T, H] in x's dtype, as two grouped GEMMs."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; the GPU path needs it")
    from vx.gpu.layers.linear import silu_and_mul

    t, top_k = ids.shape
    pairs = t * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert = align(ids, w13.shape[0], BLOCK_M)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = x.new_empty(pairs, w13.shape[1])
    _gemm(x, w13, gate_up, weights, sorted_ids, block_expert, pairs, top_k, False)
    h = silu_and_mul(gate_up).contiguous()  # [pairs, I]
    out = x.new_empty(pairs, w2.shape[1])
    w = weights.reshape(-1).float().contiguous()
    _gemm(h, w2, out, w, sorted_ids, block_expert, pairs, 1, True)
    return out.view(t, top_k, -1).sum(1)
