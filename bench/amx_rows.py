"""Time the AMX GEMM at 1-2 rows against the VDPBF16PS GEMV, per SmolLM2 shape, cold weights.

Usage (always under the exclusive benchmark lock):

    flock -x /work/coord/cpu.lock .venv/bin/python bench/amx_rows.py [--rows 1,2]
        [--rounds 9] [--threads 2]

Shapes: SmolLM2-135M's four projections (qkv 960 x 576, o 576 x 576, gate-up 3072 x 576 read
through its SiLU, down 576 x 1536), 30 layers' own weights each (they stream from memory, as
in a decode step), and the LM head 49,152 x 576 (one copy). Kernels: "GEMV", `vx_gemv_bf16`
on the plain weight (with the SiLU pass for the gate-up); "AMX", `vx_gemm_amx_vnni` (`_silu`
for the gate-up, `_rope` for qkv with SmolLM2's 9 + 3 heads of 64) on the VNNI copy. Timing:
bench/row_timing.py's (one step per kernel a round, their order rotating; each cell the median
time per matrix). First the AMX rows of 1-17-row calls are checked against the same rows of a
40-row call (the general loop): every bit the same.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.row_timing import SHAPES, options, shape_names, time_rows, weights
from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.cpu.vnni import VnniWeight

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    args = options(__doc__.splitlines()[0])
    lib = load_cpu_kernels()
    assert lib is not None and lib.vx_fast_amx(1), "needs AMX"
    g = torch.Generator().manual_seed(0)
    names = shape_names(args.only)
    mats = weights(names, g, lambda name, w: VnniWeight(w, amx=True, silu=name == "gate_up"))
    cos = torch.randn(64, HEAD_DIM // 2, generator=g).bfloat16()
    sin = torch.randn(64, HEAD_DIM // 2, generator=g).bfloat16()
    act = torch.empty(64, SHAPES["gate_up"][0] // 2, dtype=torch.bfloat16)

    def call(kind: str, name: str, w, vw, x, y) -> None:
        m, k = x.shape
        n = w.shape[0]
        if kind == "GEMV":
            rc = lib.vx_gemv_bf16(x.data_ptr(), k, m, w.data_ptr(), None, None, y.data_ptr(),
                                  n, n, k)  # fmt: skip
            if name == "gate_up":
                lib.vx_silu_and_mul_bf16(y.data_ptr(), n, act.data_ptr(), m, n // 2)
        elif name == "gate_up":
            rc = lib.vx_gemm_amx_vnni_silu(x.data_ptr(), k, m, vw.packed.data_ptr(), None,
                                           y.data_ptr(), n // 2, n // 2, k)  # fmt: skip
        elif name == "qkv":
            rc = lib.vx_gemm_amx_vnni_rope(x.data_ptr(), k, m, vw.packed.data_ptr(), None,
                                           y.data_ptr(), n, n, k, cos.data_ptr(), sin.data_ptr(),
                                           (HEADS + KV_HEADS) * HEAD_DIM, HEAD_DIM)  # fmt: skip
        else:
            rc = lib.vx_gemm_amx_vnni(x.data_ptr(), k, m, vw.packed.data_ptr(), None,
                                      y.data_ptr(), n, n, k)  # fmt: skip
        assert rc == 0, (kind, name, rc)

    # bits: each AMX row of an M-row call against the same row of a 40-row call
    for name in names:
        w, vw = mats[name][0]
        n, k = w.shape
        x40 = torch.randn(40, k, generator=g).bfloat16()
        ref = torch.empty(40, n, dtype=torch.bfloat16)
        call("AMX", name, w, vw, x40, ref)
        for m in (1, 2, 3, 5, 8, 16, 17):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            call("AMX", name, w, vw, x40[:m].clone(), y)
            width = n // 2 if name == "gate_up" else n  # the SiLU GEMM's rows are I wide
            got, want = y.flatten()[: m * width], ref.flatten()[: 40 * width]
            assert torch.equal(got, want[: m * width]), (name, m)

    time_rows(call, ("GEMV", "AMX"), ("GEMV", "AMX"), mats, names, args, g)


if __name__ == "__main__":
    main()
