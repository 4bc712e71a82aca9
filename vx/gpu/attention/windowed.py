"""Windowed attention: paged attention with a per-layer sliding window and logit soft-capping.

Runs in: each Worker process.

`WindowedAttention(window, softcap)` is an `attn_fn` as `paged_attention` is (same arguments:
q, k, v, the layer's KV cache, the step's metadata, the scale): it writes the new K/V through
`slot_mapping`, then attends:
- on CPU, the C kernels of `paged_attention` with the window and the cap as arguments (the
  decode rows in one call: fp32 or bf16; the prefill chunks in one call: bf16 on AMX,
  AVX512-BF16 or AVX2), which read only the blocks the window sees;
- on CUDA, the Triton kernel (`vx.gpu.attention.triton.paged_attention`) with both;
- what no C kernel takes (fp32 prefill chunks, a shape or CPU without a kernel), per request
  in torch, the reference: gather only the cache blocks its window can see and
  attend with HF's eager arithmetic: scores = q k^T * scale in the model dtype,
  `tanh(s / cap) * cap` if soft-capped, the causal and window mask, softmax in fp32 cast back,
  then the weighted V.

Window semantics are HF's (`masking_utils.sliding_window_overlay`): query position p sees key
positions (p - window, p], `window` keys including itself. Neither path reads a key before a
query's window, so the blocks holding only such keys may have been freed and reused (their
table entries then name block 0, or a block another request now holds). A model with global
and windowed layers reads each layer's own group's table (`AttentionMetadata.for_cache`).

Invariants: the fused CPU step reads a layer's `window` and `softcap` from this `attn_fn` at
load and hands them to the same C kernels (`FusedDecode.build`), so a layer attends alike
on either path. The models that use it stay out of CUDA
graphs (the Triton path was checked under the interpreter only, not captured on a GPU).
"""

from __future__ import annotations

import torch

from vx.gpu.attention.metadata import AttentionMetadata
from vx.gpu.attention.paged import decode_kernel, gather_blocks, prefill_kernel, write_kv_cache

__all__ = ["WindowedAttention"]


class WindowedAttention:
    """An `attn_fn` with a sliding `window` (keys, or None: the whole context) and a logit
    `softcap` (or None)."""

    def __init__(self, window: int | None, softcap: float | None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window, self.softcap = window, softcap

    def __repr__(self) -> str:
        return f"WindowedAttention(window={self.window}, softcap={self.softcap})"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        k_cache, v_cache = kv_cache
        if md.groups is not None:
            md = md.for_cache(kv_cache)
        window, cap = self.window or 0, self.softcap or 0.0
        if q.is_cuda:
            from vx.gpu.attention import triton as triton_attention

            triton_attention.write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
            return triton_attention.paged_attention(q, k_cache, v_cache, md, scale, window, cap)
        write_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
        out = q.new_empty(q.shape)
        first, last = 0, md.num_reqs  # the requests left to the torch path
        nd = md.num_decodes
        if md.prefills and prefill_kernel(q, k_cache, v_cache, md, scale, out, window, cap):
            last = nd
        if nd and decode_kernel(q[:nd], k_cache, v_cache, md, scale, out[:nd], window, cap):
            first = nd
        if first >= last:
            return out
        starts = md.query_start_loc.tolist()
        for i, seq_len in enumerate(md.seq_lens.tolist()):
            s, e = starts[i], starts[i + 1]
            if first <= i < last and e > s:
                out[s:e] = self._request(
                    q[s:e], k_cache, v_cache, md.block_table[i], seq_len, scale
                )
        return out

    def _request(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_row: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        """One request's n query rows (the last n positions of its `seq_len`)."""
        hkv, _, bs, d = k_cache.shape
        n, hq, _ = q.shape
        q_first = seq_len - n
        # The oldest key any of these queries sees; blocks before it are not read at all.
        first = 0 if self.window is None else max(0, q_first - self.window + 1)
        b0, b1 = first // bs, -(-seq_len // bs)
        ids = block_row[b0:b1].long()
        lo, hi = first - b0 * bs, seq_len - b0 * bs
        ks = gather_blocks(k_cache, ids).view(hkv, -1, d)[:, lo:hi].to(q.dtype)  # [Hkv, ctx, D]
        vs = gather_blocks(v_cache, ids).view(hkv, -1, d)[:, lo:hi].to(q.dtype)
        qh = q.view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        scores = torch.matmul(qh, ks.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, G, n, ctx]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        key_pos = torch.arange(first, seq_len, device=q.device)
        q_pos = torch.arange(q_first, seq_len, device=q.device)[:, None]
        allowed = key_pos <= q_pos
        if self.window is not None:
            allowed &= key_pos > q_pos - self.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(p, vs.unsqueeze(1))  # [Hkv, G, n, D]
        return o.permute(2, 0, 1, 3).reshape(n, hq, d)
