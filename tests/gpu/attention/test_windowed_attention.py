"""`vx.gpu.attention.windowed.WindowedAttention` against a dense float64 computation of HF's
eager attention with a sliding-window mask and logit soft-capping, over a step that mixes
decodes, fresh prefills and chunks after a cached prefix (windows cutting inside and across
blocks), with garbage in the cache outside every context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.attention.test_paged_attention import MIXED, _scenario
from vx.gpu.attention.paged import build_attention_metadata, paged_attention
from vx.gpu.attention.windowed import WindowedAttention


def _dense(q, hist_k, hist_v, reqs, g, scale, window, softcap):
    outs, off = [], 0
    for (nc, n), hk, hv in zip(reqs, hist_k, hist_v, strict=True):
        qq = q[off : off + n].double()
        off += n
        kk = hk.double().repeat_interleave(g, dim=1)
        vv = hv.double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        qpos, kpos = torch.arange(nc, nc + n)[:, None], torch.arange(nc + n)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (5, None), (17, 2.0), (None, 1.5)])
@pytest.mark.parametrize(("hkv", "g", "d"), [(2, 3, 32), (1, 4, 16)])
def test_windowed_attention_matches_dense(window, softcap, hkv, g, d) -> None:
    reqs = MIXED
    hist_k, hist_v, k_cache, v_cache, bt, q, k, v, slots = _scenario(3 + d, reqs, hkv, g, d,
                                                                      torch.float32)  # fmt: skip
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt,
        slot_mapping=slots,
        num_decodes=4,
    )
    scale = d**-0.5
    out = WindowedAttention(window, softcap)(q, k, v, (k_cache, v_cache), md, scale)
    ref = _dense(q, hist_k, hist_v, reqs, g, scale, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_no_window_no_cap_is_paged_attention() -> None:
    reqs = MIXED
    hist_k, hist_v, k_cache, v_cache, bt, q, k, v, slots = _scenario(1, reqs, 2, 2, 32,
                                                                      torch.float32)  # fmt: skip
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt,
        slot_mapping=slots,
        num_decodes=4,
    )
    caches = (k_cache.clone(), v_cache.clone())
    ours = WindowedAttention(None, None)(q, k, v, (k_cache, v_cache), md, 0.2)
    theirs = paged_attention(q, k, v, caches, md, 0.2)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
