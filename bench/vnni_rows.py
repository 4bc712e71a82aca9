"""Time the VNNI GEMM at one row against the VDPBF16PS GEMV, per SmolLM2 shape, cold weights,
on AVX512-BF16 without AMX (Zen 4 and 5; on an AMX CPU run it with ``VX_CPU_ATTENTION_AMX=0``).

Usage (always under the exclusive benchmark lock):

    flock -x /work/coord/cpu.lock env VX_CPU_ATTENTION_AMX=0 .venv/bin/python \
        bench/vnni_rows.py [--rows 1,2] [--rounds 9] [--threads 2]

Shapes: SmolLM2-135M's four projections (qkv 960 x 576, o 576 x 576, gate-up 3072 x 576,
down 576 x 1536), 30 layers' own weights each (they stream from memory, as in a decode step),
and the LM head 49,152 x 576 (one copy). Kernels: "GEMV", `vx_gemv_bf16` on the plain weight;
"VNNI", `vx_gemm_vnni_bf16` on the VNNI copy (its small-row loop up to 4 rows);
"general loop", the same with the small-row loop off (`vx_vnni_small_loop(0)`). Timing:
bench/row_timing.py's (one step per kernel a round, their order rotating; each cell the median
time per matrix). First the VNNI rows of 1-17-row calls are checked against the same rows of a
40-row call (the general loop): every bit the same.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.row_timing import options, shape_names, time_rows, weights
from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.cpu.vnni import VnniWeight


def main() -> None:
    args = options(__doc__.splitlines()[0])
    lib = load_cpu_kernels()
    assert lib is not None and lib.vx_has_gemm_vnni() and not lib.vx_fast_amx(-1), (
        "needs AVX512-BF16 with AMX off (VX_CPU_ATTENTION_AMX=0)"
    )
    g = torch.Generator().manual_seed(0)
    names = shape_names(args.only)
    mats = weights(names, g, lambda name, w: VnniWeight(w))

    def call(kind: str, name: str, w, vw, x, y) -> None:  # `name`: the harness's; unused here
        m, k = x.shape
        n = w.shape[0]
        if kind == "GEMV":
            rc = lib.vx_gemv_bf16(x.data_ptr(), k, m, w.data_ptr(), None, None, y.data_ptr(),
                                  n, n, k)  # fmt: skip
        else:
            lib.vx_vnni_small_loop(0 if kind == "general" else 4)
            rc = lib.vx_gemm_vnni_bf16(x.data_ptr(), k, m, vw.packed.data_ptr(), None,
                                       y.data_ptr(), n, n, k)  # fmt: skip
        assert rc == 0, (kind, rc)

    # bits: each VNNI row of an M-row call against the same row of a 40-row call
    for name in names:
        w, vw = mats[name][0]
        n, k = w.shape
        x40 = torch.randn(40, k, generator=g).bfloat16()
        ref = torch.empty(40, n, dtype=torch.bfloat16)
        call("VNNI", name, w, vw, x40, ref)
        for m in range(1, 18):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            call("VNNI", name, w, vw, x40[:m].clone(), y)
            assert torch.equal(y, ref[:m]), (name, m)

    kinds = ("GEMV", "VNNI", "general")
    time_rows(call, kinds, ("GEMV", "VNNI", "general loop"), mats, names, args, g)


if __name__ == "__main__":
    main()
