"""Triton kernels for the GPU path, each with the torch reference it must match beside it.

Runs in: each Worker process (CUDA devices). Importable without CUDA, and without triton (the
kernels are then missing and the wrappers raise); the tests run every kernel on CPU tensors
under ``TRITON_INTERPRET=1``.

Kernels:

- `write_kv_cache`: store new K/V [T, Hkv, D] at `slot_mapping` in the
  ``[Hkv, num_blocks, block_size, D]`` caches; a negative slot is skipped (padding).
- `paged_attention`: one program per (tile of `tile_block_m` query tokens of one request,
  query head). It walks the request's block table one KV block at a time with an online
  softmax (flash-attention style), causal with the offset of the cached prefix, GQA by
  ``kv_head = q_head // group``. Decodes are tiles with one live row. With a sliding `window`
  (> 0) a query at position p sees keys (p - window, p] (HF's), and the walk starts at the
  block of the tile's first window key (blocks before it are never read); with a `softcap`
  (> 0) each scaled score s becomes cap * tanh(s / cap) (Gemma 2's).
- `rms_norm`: residual add fused with RMSNorm, rounding exactly where `vx.gpu.layers.linear.RMSNorm`
  rounds (add in the model dtype, normalise in fp32, cast, multiply by the weight).
- `rotary_embedding`: neox (rotate-half) rotary, in place on q and k, from [max_pos, D/2]
  cos/sin caches, rounding like `vx.gpu.layers.linear.RotaryEmbedding`.

NOTE: the interpreter computes `tl.dot` on bf16 operands wrongly (numpy has no bf16), so when
``TRITON_INTERPRET=1`` the attention kernel upcasts its dot operands to fp32 (`DOT_FP32`); on a
GPU they stay in the input dtype for the tensor cores. The interpreter also rounds fp32 -> bf16
casts toward zero where a GPU rounds to nearest even, so bf16 results there can differ from the
torch references by one ulp (the tests allow exactly that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vx import envs

if TYPE_CHECKING:
    from vx.gpu.attention.metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships on linux x86_64 only
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]


#: Whether triton's interpreter runs the kernels below: ``TRITON_INTERPRET`` at this import,
#: when `triton.jit` makes each kernel interpreted or compiled for the module's life (a
#: later change of the variable does not switch them; tests/gpu/test_triton.py reloads this
#: module after setting it).
_INTERPRETING: bool = envs.TRITON_INTERPRET


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; the GPU path needs it")


def _np2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ───────────────────────────── torch references ─────────────────────────────


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Reference: k/v [T, Hkv, D] to their slots; negative slots are skipped."""
    hkv, nb, bs, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # by (block, offset): the CPU's caches are block-major in memory, not one [Hkv, NB * BS]
    blocks, offsets = slots // bs, slots % bs
    k_cache[:, blocks, offsets] = k[keep].transpose(0, 1).to(k_cache.dtype)
    v_cache[:, blocks, offsets] = v[keep].transpose(0, 1).to(v_cache.dtype)


def paged_attention_ref(
    q, k_cache, v_cache, md: AttentionMetadata, scale: float, window: int = 0,
    softcap: float = 0.0,
):  # fmt: skip
    """Reference: per request, gather the context through the block table; fp32 softmax; a
    sliding `window` and a logit `softcap` (<= 0: none)."""
    hkv, _, bs, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    for i in range(md.num_reqs):
        s, e, ctx = qsl[i], qsl[i + 1], seq_lens[i]
        nblk = -(-ctx // bs)
        # from the block of the first query's window on (the blocks before are never read)
        b0 = max(0, ctx - (e - s) - window + 1) // bs if window > 0 else 0
        ids = md.block_table[i, b0:nblk].long()
        kk = k_cache[:, ids].reshape(hkv, -1, d)[:, : ctx - b0 * bs].float()
        vv = v_cache[:, ids].reshape(hkv, -1, d)[:, : ctx - b0 * bs].float()
        kk, vv = kk.repeat_interleave(g, 0), vv.repeat_interleave(g, 0)
        qq = q[s:e].float().transpose(0, 1)  # [Hq, n, D]
        scores = qq @ kk.transpose(1, 2) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (e - s), ctx, device=q.device)[:, None]
        k_pos = torch.arange(b0 * bs, ctx, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, -torch.inf)
        out[s:e] = (scores.softmax(-1) @ vv).transpose(0, 1).to(q.dtype)
    return out


def rms_norm_ref(x, weight, eps: float, residual=None):
    """Reference (== vx.gpu.layers.linear.RMSNorm): returns out, or (out, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding_ref(positions, q, k, cos, sin):
    """Reference (== vx.gpu.layers.linear.RotaryEmbedding): rotated copies of q [T,Hq,D], k [T,Hkv,D]."""

    def rot(x):
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rot(q), rot(k)


# ───────────────────────────── kernels ─────────────────────────────

if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
        s_kt, s_kh, s_vt, s_vh,
        s_ch, s_cb, s_cs,
        HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < HKV) & (d < D)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            dst = h * s_ch + blk * s_cb + off * s_cs + d
            kv = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=mask)
            tl.store(kc_ptr + dst, kv, mask=mask)
            vv = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=mask)
            tl.store(vc_ptr + dst, vv, mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, o_ptr, kc_ptr, vc_ptr,
        bt_ptr, qsl_ptr, seq_lens_ptr, tile_req_ptr, tile_qs_ptr,
        s_qt, s_qh, s_ot, s_oh, s_ch, s_cb, s_cs, s_bt,
        scale, window, softcap,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
        IEEE: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        req = tl.load(tile_req_ptr + tile)
        q_tile = tl.load(tile_qs_ptr + tile)
        q0 = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q0
        seq_len = tl.load(seq_lens_ptr + req)
        num_computed = seq_len - q_len

        offs_m = q_tile + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_len
        d_ok = offs_d < D
        q = tl.load(
            q_ptr + (q0 + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :],
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = num_computed + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys past the tile's last query position are masked anyway: stop there.
        kv_end = tl.minimum(seq_len, num_computed + q_tile + BLOCK_M)
        num_blocks = tl.cdiv(kv_end, BLOCK_SIZE)
        offs_s = tl.arange(0, BLOCK_SIZE)
        first_block = 0
        if WINDOWED:  # keys before the tile's first query's window: never read
            first_block = tl.maximum(num_computed + q_tile - window + 1, 0) // BLOCK_SIZE
        for b in range(first_block, num_blocks):
            blk = tl.load(bt_ptr + req * s_bt + b).to(tl.int64)
            kv_off = kvh * s_ch + blk * s_cb + offs_s[:, None] * s_cs + offs_d[None, :]
            k = tl.load(kc_ptr + kv_off, mask=d_ok[None, :], other=0.0)
            v = tl.load(vc_ptr + kv_off, mask=d_ok[None, :], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # fp32 caches: tl.dot would round to TF32 on Ampere and later; fp32 models ask
            # for fp32 results (the parity tests compare them with HF's fp32).
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            if SOFTCAP:  # cap * tanh(s / cap), tanh from exp(-2|x|) (no overflow)
                x = scores / softcap
                t = tl.exp(-2.0 * tl.abs(x))
                th = (1.0 - t) / (1.0 + t)
                scores = tl.where(x < 0, -th, th) * softcap
            key_pos = b * BLOCK_SIZE + offs_s
            ok = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < seq_len)
            if WINDOWED:
                ok = ok & (key_pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(ok, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row with nothing visible yet keeps m = -inf; shift by 0 to avoid inf - inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            o_ptr + (q0 + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        s_x, s_r, s_o, s_ro,
        N, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(x_ptr + t * s_x + offs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + t * s_r + offs, mask=ok, other=0.0)
            # Rounded to the model dtype, as the torch add is.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + t * s_ro + offs, x, mask=ok)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / N
        normed = (h * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * s_o + offs, out, mask=ok)

    @triton.jit
    def _rotary_kernel(
        x_ptr, pos_ptr, cos_ptr, sin_ptr,
        s_xt, s_xh, s_c,
        H, HALF,
        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        ok = (h < H) & (i < HALF)
        c = tl.load(cos_ptr + pos * s_c + i, mask=i < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * s_c + i, mask=i < HALF, other=0.0).to(tl.float32)
        base = x_ptr + t * s_xt + h * s_xh + i
        x1 = tl.load(base, mask=ok, other=0.0)
        x2 = tl.load(base + HALF, mask=ok, other=0.0)
        dt = x1.dtype
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        # Round each product to the model dtype before the add, as the torch ops do.
        o1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        tl.store(base, o1, mask=ok)
        tl.store(base + HALF, o2, mask=ok)


# ───────────────────────────── wrappers ─────────────────────────────


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Triton: k/v [T, Hkv, D] to their slots in the caches (negative slots skipped)."""
    _require_triton()
    hkv, _, bs, d = k_cache.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the last dim of k, v and the caches must be contiguous")
    t = k.shape[0]
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, D=d, BLOCK_SIZE=bs, BLOCK_H=_np2(hkv), BLOCK_D=_np2(d),
    )  # fmt: skip


def paged_attention(
    q, k_cache, v_cache, md: AttentionMetadata, scale: float, window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Triton: q [T, Hq, D] over the paged caches -> [T, Hq, D], with a sliding `window` and
    a logit `softcap` (<= 0: none). Needs `md.tile_req`."""
    _require_triton()
    if md.tile_req is None or md.tile_q_start is None:
        raise ValueError("attention metadata was built without Triton tiles")
    hkv, _, bs, d = k_cache.shape
    hq = q.shape[1]
    out = torch.empty_like(q)
    num_tiles = md.tile_req.shape[0]
    if num_tiles == 0:
        return out
    _paged_attention_kernel[(num_tiles, hq)](
        q, out, k_cache, v_cache,
        md.block_table, md.query_start_loc, md.seq_lens, md.tile_req, md.tile_q_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), md.block_table.stride(0),
        scale, max(int(window), 0), float(softcap) if softcap > 0 else 1.0,
        GROUP=hq // hkv, D=d, BLOCK_SIZE=bs, BLOCK_M=md.tile_block_m, BLOCK_D=max(_np2(d), 16),
        DOT_FP32=_INTERPRETING, IEEE=_INTERPRETING or q.dtype == torch.float32,
        WINDOWED=window > 0, SOFTCAP=softcap > 0,
    )  # fmt: skip
    return out


def rms_norm(x, weight, eps: float, residual=None):
    """Triton: out, or (out, x + residual), for x [T, N]; matches `rms_norm_ref`."""
    _require_triton()
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if t:
        _rms_norm_kernel[(t,)](
            x, res, weight, out, res_out,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=_np2(n),
        )  # fmt: skip
    return out if residual is None else (out, res_out)


def rotary_embedding(positions, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: rotate q [T, Hq, D] and k [T, Hkv, D] in place; returns (q, k)."""
    _require_triton()
    t, _, d = q.shape
    half = d // 2
    if cos.shape[-1] != half or cos.stride(0) != sin.stride(0):
        raise ValueError("cos/sin must be [max_pos, head_dim // 2] with equal strides")
    if t:
        for x in (q, k):
            if x.stride(-1) != 1:
                raise ValueError("the last dim of q and k must be contiguous")
            _rotary_kernel[(t,)](
                x, positions, cos, sin,
                x.stride(0), x.stride(1), cos.stride(0),
                x.shape[1], half,
                BLOCK_H=_np2(x.shape[1]), BLOCK_HALF=_np2(half),
            )  # fmt: skip
    return q, k
