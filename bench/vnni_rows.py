"""Time the VNNI GEMM at one row against the VDPBF16PS GEMV, per SmolLM2 shape, cold weights,
on AVX512-BF16 without AMX (Zen 4 and 5; on an AMX CPU run it with ``VX_CPU_ATTENTION_AMX=0``).

Usage (always under the exclusive benchmark lock):

    flock -x /work/coord/cpu.lock env VX_CPU_ATTENTION_AMX=0 .venv/bin/python \
        bench/vnni_rows.py [--rows 1,2] [--rounds 9] [--threads 2]

Shapes: SmolLM2-135M's four projections (qkv 960 x 576, o 576 x 576, gate-up 3072 x 576,
down 576 x 1536), 30 layers' own weights each (they stream from memory, as in a decode step),
and the LM head 49,152 x 576 (one copy). Kernels: "GEMV", `vx_gemv_bf16` on the plain weight;
"VNNI", `vx_gemm_vnni_bf16` on the VNNI copy (its small-row loop up to 4 rows);
"general loop", the same with the small-row loop off (`vx_vnni_small_loop(0)`). A round runs one step per kernel (each layer's
four matrices in order, then the head), the kernels in turn, the first one alternating. Each
cell is the median over `--rounds` rounds of the time per matrix, each call timed alone from
Python (a ctypes call's few microseconds included). First the VNNI rows of 1-17-row calls are
checked against the same rows of a 40-row call (the general loop): every bit the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.cpu.vnni import VnniWeight

logger = logging.getLogger("bench.vnni_rows")

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    lib = load_cpu_kernels()
    assert lib is not None and lib.vx_has_gemm_vnni() and not lib.vx_fast_amx(-1), (
        "needs AVX512-BF16 with AMX off (VX_CPU_ATTENTION_AMX=0)"
    )
    g = torch.Generator().manual_seed(0)
    names = list(SHAPES) + ["head"]
    if args.only:
        names = args.only.split(",")
    mats: dict[str, list] = {}
    for name in names:
        n, k = SHAPES.get(name, HEAD)
        copies = 1 if name == "head" else LAYERS
        ws = []
        for _ in range(copies):
            w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            ws.append((w, VnniWeight(w)))
        mats[name] = ws

    def call(kind: str, w, vw, x, y) -> None:
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
        call("VNNI", w, vw, x40, ref)
        for m in range(1, 18):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            call("VNNI", w, vw, x40[:m].clone(), y)
            assert torch.equal(y, ref[:m]), (name, m)

    kinds = ("GEMV", "VNNI", "general")
    for m in [int(r) for r in args.rows.split(",")]:
        times: dict[tuple[str, str], list[float]] = {}
        xs = {nm: torch.randn(m, mats[nm][0][0].shape[1], generator=g).bfloat16() for nm in names}
        ys = {nm: torch.empty(m, mats[nm][0][0].shape[0], dtype=torch.bfloat16) for nm in names}
        for rnd in range(args.rounds):
            for kind in kinds[rnd % 3 :] + kinds[: rnd % 3]:
                acc = dict.fromkeys(names, 0.0)
                for layer in range(LAYERS):
                    for name in names:
                        if name == "head" and layer != LAYERS - 1:
                            continue
                        w, vw = mats[name][0 if name == "head" else layer]
                        t0 = time.perf_counter()
                        call(kind, w, vw, xs[name], ys[name])
                        acc[name] += time.perf_counter() - t0
                for name in names:
                    per = acc[name] * 1e6 / (1 if name == "head" else LAYERS)
                    times.setdefault((name, kind), []).append(per)
        logger.info("%d row(s), %d threads, us per matrix (median of %d)", m, args.threads,
                    args.rounds)  # fmt: skip
        logger.info("| shape | GEMV | VNNI | general loop | VNNI / GEMV |")
        logger.info("|---|---:|---:|---:|---:|")
        tot = dict.fromkeys(kinds, 0.0)
        for name in names:
            a, b, c = (statistics.median(times[(name, kd)]) for kd in kinds)
            scale = 1 if name == "head" else LAYERS
            for kd, v in zip(kinds, (a, b, c), strict=True):
                tot[kd] += v * scale
            n, k = mats[name][0][0].shape
            logger.info("| %s %d x %d | %.1f | %.1f | %.1f | %.2f |", name, n, k, a, b, c, b / a)
        logger.info("| step (x 30 + head) | %.0f | %.0f | %.0f | %.2f |", tot["GEMV"],
                    tot["VNNI"], tot["general"], tot["VNNI"] / tot["GEMV"])  # fmt: skip


if __name__ == "__main__":
    main()
