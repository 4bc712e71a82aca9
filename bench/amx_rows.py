"""Time the AMX GEMM at 1-2 rows against the VDPBF16PS GEMV, per SmolLM2 shape, cold weights.

Usage (always under the exclusive benchmark lock):

    flock -x /work/coord/cpu.lock .venv/bin/python bench/amx_rows.py [--rows 1,2]
        [--rounds 9] [--threads 2]

Shapes: SmolLM2-135M's four projections (qkv 960 x 576, o 576 x 576, gate-up 3072 x 576 read
through its SiLU, down 576 x 1536), 30 layers' own weights each (they stream from memory, as
in a decode step), and the LM head 49,152 x 576 (one copy). Kernels: "GEMV", `vx_gemv_bf16`
on the plain weight (with the SiLU pass for the gate-up); "AMX", `vx_gemm_amx_vnni` (`_silu`
for the gate-up, `_rope` for qkv with SmolLM2's 9 + 3 heads of 64) on the VNNI copy. A round
runs one step per kernel (each layer's four matrices in order, then the head), the kernels in
turn, the first one alternating. Each cell is the median over `--rounds` rounds of the time
per matrix, each call timed alone from Python (a ctypes call's few microseconds included).
First the AMX rows of 1-17-row calls are checked against the same rows of a 40-row call (the
general loop): every bit the same.
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

logger = logging.getLogger("bench.amx_rows")

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
HEAD = (49152, 576)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


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
    assert lib is not None and lib.vx_fast_amx(1), "needs AMX"
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
            ws.append((w, VnniWeight(w, amx=True, silu=name == "gate_up")))
        mats[name] = ws
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

    kinds = ("GEMV", "AMX")
    for m in [int(r) for r in args.rows.split(",")]:
        times: dict[tuple[str, str], list[float]] = {}
        xs = {nm: torch.randn(m, mats[nm][0][0].shape[1], generator=g).bfloat16() for nm in names}
        ys = {nm: torch.empty(m, mats[nm][0][0].shape[0], dtype=torch.bfloat16) for nm in names}
        for rnd in range(args.rounds):
            # one step per kernel, in turn, the first one alternating (a fixed order favoured
            # the later ones); a layer's matrices in order, then the head
            for kind in kinds[rnd % 2 :] + kinds[: rnd % 2]:
                acc = dict.fromkeys(names, 0.0)
                for layer in range(LAYERS):
                    for name in names:
                        if name == "head" and layer != LAYERS - 1:
                            continue
                        w, vw = mats[name][0 if name == "head" else layer]
                        t0 = time.perf_counter()
                        call(kind, name, w, vw, xs[name], ys[name])
                        acc[name] += time.perf_counter() - t0
                for name in names:
                    per = acc[name] * 1e6 / (1 if name == "head" else LAYERS)
                    times.setdefault((name, kind), []).append(per)
        logger.info("%d row(s), %d threads, us per matrix (median of %d)", m, args.threads,
                    args.rounds)  # fmt: skip
        logger.info("| shape | GEMV | AMX | AMX / GEMV |")
        logger.info("|---|---:|---:|---:|")
        tot = {"GEMV": 0.0, "AMX": 0.0}
        for name in names:
            a, b = (statistics.median(times[(name, kd)]) for kd in ("GEMV", "AMX"))
            scale = 1 if name == "head" else LAYERS
            tot["GEMV"] += a * scale
            tot["AMX"] += b * scale
            n, k = mats[name][0][0].shape
            logger.info("| %s %d x %d | %.1f | %.1f | %.2f |", name, n, k, a, b, b / a)
        logger.info("| step (x 30 + head) | %.0f | %.0f | %.2f |", tot["GEMV"], tot["AMX"],
                    tot["AMX"] / tot["GEMV"])  # fmt: skip


if __name__ == "__main__":
    main()
