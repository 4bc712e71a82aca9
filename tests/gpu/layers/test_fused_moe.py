"""`vx.gpu.layers.fused_moe`: the grouped torch experts against a dense loop over every
(token, slot), for any batch, and the tensor-parallel slices summing to the whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vx.gpu.layers.fused_moe import FusedMoE, moe_reference, select_experts

E, K, H, INTER = 8, 2, 32, 48


def _dense(x, w13, w2, weights, ids):
    """Every (token, slot) through its expert, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = F.linear(x[t], w13[ids[t, j]]).chunk(2)
            out[t] += F.linear(F.silu(gate) * up, w2[ids[t, j]]) * weights[t, j]
    return out


@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
def test_grouped_equals_dense(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = select_experts(logits, K, renormalize=True, weights_in_fp32=True)
    assert ids.shape == (tokens, K)
    if tokens:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    got = moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, _dense(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_select_experts_without_renormalisation() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 2, renormalize=False, weights_in_fp32=False)
    probs = torch.softmax(logits.float(), -1)
    assert ids.tolist() == [[3, 2]] and weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float(), probs[:, [3, 2]], atol=1e-2, rtol=1e-2)


def test_tensor_parallel_slices_sum_to_the_whole() -> None:
    """Each rank's slice of every expert (loaded from the full HF tensors) gives a partial sum;
    the two ranks' partials (what the all-reduce adds) equal the unsharded output."""
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(E, INTER, H, generator=g), torch.randn(E, INTER, H, generator=g)
    down = torch.randn(E, H, INTER, generator=g)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)

    def build(rank: int, size: int) -> FusedMoE:
        moe = FusedMoE(
            E, K, H, INTER, renormalize=True, weights_in_fp32=True,
            dtype=torch.float32, device=torch.device("cpu"), tp_rank=rank, tp_size=size,
        )  # fmt: skip
        for e in range(E):
            moe.weight_loader(gate[e], e, "gate")
            moe.weight_loader(up[e], e, "up")
            moe.weight_loader(down[e], e, "down")
        return moe

    whole = build(0, 1)(x, logits)
    weights, ids = select_experts(logits, K, renormalize=True, weights_in_fp32=True)
    parts = [build(r, 2) for r in range(2)]
    partial = sum(moe_reference(x, m.w13, m.w2, weights, ids) for m in parts)
    torch.testing.assert_close(partial, whole, atol=1e-4, rtol=1e-4)
