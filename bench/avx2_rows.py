"""Time the AVX2 build's small-row GEMMs on SmolLM2-135M's 120 layer matrices, from the forced
x86-64-v3 build (any AVX2 CPU; on Zen 3 the native build is the same code).

Usage (always under the exclusive benchmark lock, from a neutral cwd):

    flock -x -w 1800 /work/coord/cpu.lock .venv/bin/python bench/avx2_rows.py \
        [--rows 1,2,3,4] [--rounds 15] [--old-csrc OLD/vx/gpu/cpu/csrc]

Kernels, per row count: "compact", `vx_gemv_compact_avx2` on the compact copy in panel order
(the default path for 1-4 rows: the panel GEMM's bits); "skinny", `vx_gemv_bf16_avx2` on the
bf16 weight; "panels", `vx_gemm_panels_avx2` (its small-row loop up to 4 rows), "panels general" the same
with that loop off (`vx_panel_small_loop(0)`); with `--old-csrc` (an older tree's kernel
sources, e.g. from `git archive`), "old compact": that tree's `vx_gemv_compact_avx2` on the
row-major compact copy (`pack_compact(W)`, its 1-2 rows). Shapes: qkv 960 x 576, o 576 x 576,
gate-up 3072 x 576, down 576 x 1536, 30 layers' own random weights (they stream from memory, as
in a decode step), or with `--safetensors` a model's own 2-D layer weights (N % 16, K % 32).
A round runs one step (all 120 matrices) per kernel, in turn; each cell is
the median over `--rounds` rounds of the step's time. Outputs are checked first: "compact"
against "panels", bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vx.gpu.cpu import library
from vx.gpu.cpu.compact import pack_compact, panel_order

logger = logging.getLogger("bench.avx2_rows")
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def build(csrc: str, out: str) -> ctypes.CDLL:
    """The kernel library of `csrc` at -march=x86-64-v3, its three GEMMs bound."""
    flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in library.CFLAGS]
    subprocess.run(["cc", *flags, "-I", csrc, "-o", out, f"{csrc}/vx_kernels.c"], check=True)
    lib = ctypes.CDLL(out)
    lib.vx_gemv_compact_avx2.argtypes = [_P, _I64, _I, _P, _P, _P, _P, _P, _I64, _I64, _I64]
    lib.vx_gemv_bf16_avx2.argtypes = [_P, _I64, _I, _P, _P, _P, _I64, _I64, _I64]
    lib.vx_gemm_panels_avx2.argtypes = lib.vx_gemv_bf16_avx2.argtypes
    if hasattr(lib, "vx_panel_small_loop"):
        lib.vx_panel_small_loop.argtypes = [_I]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--old-csrc", default=None)
    ap.add_argument("--safetensors", default=None, help="a model's weights instead of random")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tmp = tempfile.mkdtemp(prefix="vx-avx2-rows-")
    lib = build(library.CSRC, os.path.join(tmp, "new.so"))
    old = build(args.old_csrc, os.path.join(tmp, "old.so")) if args.old_csrc else None
    g = torch.Generator().manual_seed(0)
    if args.safetensors:  # a model's own layer weights (their raw blocks as they come)
        from safetensors.torch import load_file

        ws = [w.bfloat16().contiguous() for name, w in load_file(args.safetensors).items()
              if w.dim() == 2 and "embed" not in name and w.shape[0] % 16 == 0
              and w.shape[1] % 32 == 0]  # fmt: skip
        SHAPES[:] = [tuple(w.shape) for w in ws]
    else:
        ws = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in SHAPES]
    compact = [pack_compact(panel_order(w)) for w in ws]
    # `pack_panels`' layout (it asks this CPU's native build, which may have no panel GEMM)
    panels = [
        w.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
        for w, (n, k) in zip(ws, SHAPES, strict=True)
    ]
    assert all(p.data_ptr() % 32 == 0 for p in panels)
    rowmajor = [pack_compact(w) for w in ws] if old else None

    def step(kernel: str, m: int, xk: dict[int, torch.Tensor], ys: list[torch.Tensor]) -> float:
        """One decode step's matrices (all 120, in order) by `kernel`; its seconds."""
        t = time.perf_counter()
        for i, ((n, k), w, y) in enumerate(zip(SHAPES, ws, ys, strict=True)):
            x = xk[k]
            if kernel in ("compact", "old compact"):
                fn, c = (lib, compact[i]) if kernel == "compact" else (old, rowmajor[i])
                rc = fn.vx_gemv_compact_avx2(x.data_ptr(), k, m, c[0].data_ptr(),
                                             c[1].data_ptr(), c[2].data_ptr(), None,
                                             y.data_ptr(), n, n, k)  # fmt: skip
            elif kernel == "skinny":
                rc = lib.vx_gemv_bf16_avx2(x.data_ptr(), k, m, w.data_ptr(), None, y.data_ptr(),
                                           n, n, k)  # fmt: skip
            else:  # "panels" (the small-row loop up to 4 rows), "panels general" (without)
                lib.vx_panel_small_loop(int(kernel == "panels"))
                rc = lib.vx_gemm_panels_avx2(x.data_ptr(), k, m, panels[i].data_ptr(), None,
                                             y.data_ptr(), n, n, k)  # fmt: skip
            assert rc == 0, (kernel, rc)
        return time.perf_counter() - t

    for m in (int(r) for r in args.rows.split(",")):
        kernels = ["compact", "skinny", "panels", "panels general"]
        kernels += ["old compact"] if old and m <= 2 else []
        xk = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in SHAPES}}
        ys = {kn: [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in SHAPES] for kn in kernels}
        times: dict[str, list[float]] = {kn: [] for kn in kernels}
        for r in range(args.rounds + 1):  # round 0 warms up
            for kn in kernels[r % len(kernels) :] + kernels[: r % len(kernels)]:
                dt = step(kn, m, xk, ys[kn])
                if r:
                    times[kn].append(dt)
        for a, b in zip(ys["compact"], ys["panels"], strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), m
        cells = "  ".join(f"{kn} {statistics.median(v) * 1e3:.2f}" for kn, v in times.items())
        logger.info("rows %d (ms a step, medians of %d): %s", m, args.rounds, cells)


if __name__ == "__main__":
    main()
