"""The timing harness of bench/amx_rows.py and bench/vnni_rows.py: kernels at a few rows on
SmolLM2-135M's decode-step matrices, cold weights, one markdown table per row count.

Shapes: SmolLM2-135M's four projections (`SHAPES`), `LAYERS` layers' own weights each (they
stream from memory, as in a decode step), and the LM head `HEAD` (one copy), named "head". A
round runs one step per kernel (each layer's matrices in order, then the head), the kernels in
turn, the first one rotating. Each cell is the median over `--rounds` rounds of the time per
matrix, each call timed alone from Python (a ctypes call's few microseconds included); the last
column is the second kernel over the first, and the step row sums each kernel's medians over
`LAYERS` layers and the head. The scripts keep their own kernel calls and bit checks.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger("bench.row_timing")

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
HEAD = (49152, 576)

# call(kind, name, w, packed, x, y): y = x @ w.T by `kind` (x m rows, y m x n, bf16)
Call = Callable[[str, str, torch.Tensor, Any, torch.Tensor, torch.Tensor], None]
Weights = dict[str, list[tuple[torch.Tensor, Any]]]
Pack = Callable[[str, torch.Tensor], Any]  # (name, w): the kernel's copy of w


def options(description: str) -> argparse.Namespace:
    """The scripts' shared CLI, parsed (`--rows`, `--rounds`, `--threads`, `--only`); logging
    then writes bare messages and torch uses `--threads` threads."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    return args


def shape_names(only: str | None) -> list[str]:
    """The matrices to time, in step order: `--only`'s names (any unknown name is the head's
    shape), else the four projections and "head"."""
    return only.split(",") if only else [*SHAPES, "head"]


def weights(names: Sequence[str], g: torch.Generator, pack: Pack) -> Weights:
    """Per name its `LAYERS` random bf16 weights (the head: one), each with `pack(name, w)`,
    drawn from `g` in `names` order (so a run's weights follow from the seed alone)."""
    mats: Weights = {}
    for name in names:
        n, k = SHAPES.get(name, HEAD)
        copies = 1 if name == "head" else LAYERS
        ws = []
        for _ in range(copies):
            w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            ws.append((w, pack(name, w)))
        mats[name] = ws
    return mats


def _step_times(
    call: Call,
    kinds: Sequence[str],
    mats: Weights,
    names: Sequence[str],
    m: int,
    rounds: int,
    g: torch.Generator,
) -> dict[tuple[str, str], list[float]]:
    """Per (name, kind) the microseconds per matrix of each round's step, `m` rows."""
    times: dict[tuple[str, str], list[float]] = {}
    xs = {nm: torch.randn(m, mats[nm][0][0].shape[1], generator=g).bfloat16() for nm in names}
    ys = {nm: torch.empty(m, mats[nm][0][0].shape[0], dtype=torch.bfloat16) for nm in names}
    for rnd in range(rounds):
        # one step per kernel, in turn, the first one rotating (a fixed order favoured the
        # later ones); a layer's matrices in order, then the head
        r = rnd % len(kinds)
        for kind in [*kinds[r:], *kinds[:r]]:
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
    return times


def time_rows(
    call: Call,
    kinds: Sequence[str],
    labels: Sequence[str],
    mats: Weights,
    names: Sequence[str],
    args: argparse.Namespace,
    g: torch.Generator,
) -> None:
    """Per `--rows` count, time `kinds` (at least two; columns headed `labels`) and log the
    table: a row per matrix, then the step's totals; the last column is kinds[1] / kinds[0]."""
    ratio = f"{labels[1]} / {labels[0]}"
    row = "| %s %d x %d | " + " | ".join(["%.1f"] * len(kinds)) + " | %.2f |"
    step_row = "| step (x %d + head) | " + " | ".join(["%.0f"] * len(kinds)) + " | %.2f |"
    for m in [int(r) for r in args.rows.split(",")]:
        times = _step_times(call, kinds, mats, names, m, args.rounds, g)
        logger.info(
            "%d row(s), %d threads, us per matrix (median of %d)", m, args.threads, args.rounds
        )
        logger.info("| shape | %s | %s |", " | ".join(labels), ratio)
        logger.info("|---|%s---:|", "---:|" * len(kinds))
        tot = dict.fromkeys(kinds, 0.0)
        for name in names:
            med = [statistics.median(times[(name, kd)]) for kd in kinds]
            scale = 1 if name == "head" else LAYERS
            for kd, v in zip(kinds, med, strict=True):
                tot[kd] += v * scale
            n, k = mats[name][0][0].shape
            logger.info(row, name, n, k, *med, med[1] / med[0])
        step = [tot[kd] for kd in kinds]
        logger.info(step_row, LAYERS, *step, step[1] / step[0])
