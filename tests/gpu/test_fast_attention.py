"""The AVX512-BF16 CPU decode attention kernel (`set_fast_decode_attention`, on with
`--quantization`): it must match an fp32 reference like the portable kernel does, and the
default stays the portable kernel.

Runs in: the test process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.gpu.attention import build_attention_metadata, paged_attention
from vx.gpu.kv_cache import (
    decode_kernel_fn,
    fast_decode_attention,
    load_cpu_kernels,
    set_fast_decode_attention,
)

BS = 16


def _has_fast() -> bool:
    lib = load_cpu_kernels()
    return lib is not None and decode_kernel_fn(torch.bfloat16, fast=True) is not decode_kernel_fn(
        torch.bfloat16
    )


@pytest.fixture(autouse=True)
def _reset():
    yield
    set_fast_decode_attention(None)


def test_default_is_the_portable_kernel(monkeypatch) -> None:
    monkeypatch.delenv("VX_CPU_ATTENTION_KERNEL", raising=False)
    assert not fast_decode_attention()
    monkeypatch.setenv("VX_CPU_ATTENTION_KERNEL", "fast")
    assert fast_decode_attention()
    set_fast_decode_attention(False)
    assert not fast_decode_attention()


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 2, 32), (8, 8, 128), (4, 2, 16)])
def test_fast_decode_matches_reference(hq: int, hkv: int, d: int) -> None:
    if not _has_fast():
        pytest.skip("no AVX512-BF16 kernel on this machine")
    g = torch.Generator().manual_seed(0)
    lens = np.array([1, 17, 200, 64, 33])
    b, nb = len(lens), 80
    kc = torch.randn(hkv, nb, BS, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(hkv, nb, BS, d, generator=g).to(torch.bfloat16)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    width = -(-int(lens.max()) // BS)
    perm = torch.randperm(nb, generator=g).numpy()
    table = perm[: b * width].reshape(b, width).astype(np.int32)
    # this step's token (the last position) is written to its slot by paged_attention
    last = lens - 1
    slots = table[np.arange(b), last // BS].astype(np.int64) * BS + last % BS
    k_new = torch.randn(b, hkv, d, generator=g).to(torch.bfloat16)
    v_new = torch.randn(b, hkv, d, generator=g).to(torch.bfloat16)
    md = build_attention_metadata(
        query_lens=np.ones(b, dtype=np.int64), num_computed=lens - 1, block_table=table,
        slot_mapping=slots, num_decodes=b,
    )  # fmt: skip
    scale = d**-0.5
    outs = {}
    for fast in (False, True):
        set_fast_decode_attention(fast)
        outs[fast] = paged_attention(q, k_new, v_new, (kc, vc), md, scale)
    for i, n in enumerate(lens.tolist()):
        blocks = torch.from_numpy(table[i].astype(np.int64))
        k = kc[:, blocks].reshape(hkv, -1, d)[:, :n].float()
        v = vc[:, blocks].reshape(hkv, -1, d)[:, :n].float()
        qq = q[i].float().view(hkv, hq // hkv, d)
        ref = (torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(hq, d)
        for fast, out in outs.items():
            torch.testing.assert_close(out[i].float(), ref, atol=2e-2, rtol=2e-2, msg=str(fast))
    # the two kernels differ by fp32 summation order only: bf16 outputs within one ulp
    diff = (outs[True].float() - outs[False].float()).abs()
    assert (diff <= outs[False].float().abs() * 2.0**-7 + 1e-6).all()
