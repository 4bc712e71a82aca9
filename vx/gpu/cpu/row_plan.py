"""The row plan of the prepacked linears: how many rows each oneDNN call takes.

Runs in: each Worker process on CPU (`ModelRunner.load_model` tunes it once; every prepacked
`vx.gpu.layers.linear_method.OneDnnLinear` call of more than `AMX_MAX_ROWS` rows asks it).

Why: oneDNN's bf16 AMX matmul picks its blocking from (rows, N, K) and, for some of them,
leaves all the work to one of the threads. On a 2-core Sapphire Rapids, SmolLM2's o projection
(576 x 576) from 352 to 832 rows and its down projection (576 x 1,536) from 224 to 1,088 rows
ran well below their rate at 2,048 rows, and the same calls with one thread took the same
time. Those are the rows of a served step that mixes 64 decodes with a few 128-token prompts
(~576 rows). Cut into calls of rows oneDNN does spread, the same product takes less time
(measured).

The plan is measured, not assumed (the blocking differs with the CPU, the thread count and
the oneDNN version): `tune` times one oneDNN call of each distinct weight shape at every
multiple of `GRID_STEP` rows up to `GRID_MAX`, and `chunk_rows` then picks, for m rows, the
whole call or calls of c rows (c a grid size) plus one call for the rest, by those times.

Invariants: a plan only splits rows, each call is the same oneDNN product on a contiguous
slice of x, so the result is a row-wise product as before; row results may differ from the
whole call's in the last bf16 bit, as they already do between steps of other sizes (oneDNN's
reduction order follows its blocking). A chunked plan is taken only when its estimate beats
the whole call's by `MIN_GAIN`; shapes never tuned, rows past `GRID_MAX` and
`VX_CPU_ROW_PLAN=0` keep the whole call. ``VX_CPU_ROW_PLAN`` is read once, by the load's
`tune` (or the first `chunk_rows`, if that comes first), and kept for the process's life:
`chunk_rows` asks on every new row count of a step.
"""

from __future__ import annotations

import logging
import time

import torch

from vx import envs

logger = logging.getLogger(__name__)

__all__ = [
    "GRID_MAX",
    "GRID_STEP",
    "chunk_rows",
    "clear",
    "plan_from_times",
    "tune",
    "tune_vnni",
    "vnni_wins",
]

GRID_STEP = 32
GRID_MAX = 2048
#: A chunked plan must be estimated at most this fraction of the whole call's time.
MIN_GAIN = 0.85
#: Smaller weights are not tuned (whole calls): a test model's, too small to be worth the
#: start-up its timing costs, and under the size vx's own GEMMs run on one thread.
MIN_WEIGHT_ELEMENTS = 1 << 18
_REPEATS = 5

#: (N, K) -> seconds of one oneDNN call at GRID_STEP * (i + 1) rows.
_times: dict[tuple[int, int], list[float]] = {}
#: (N, K, m) -> the rows per call chosen (m: the whole call).
_plans: dict[tuple[int, int, int], int] = {}
#: (N, K) -> seconds of one AMX VNNI GEMM call (`vx.gpu.cpu.vnni`) at the grid sizes from
#: VNNI_FROM rows; (N, K, m) -> whether it beats oneDNN's plan for m rows.
_vnni_times: dict[tuple[int, int], list[float]] = {}
_vnni_wins: dict[tuple[int, int, int], bool] = {}
#: The first grid size timed for the AMX VNNI GEMM: below it (the skinny GEMM's rows) it is
#: taken without asking (`vx.gpu.cpu.vnni`).
VNNI_FROM = 224
#: Whether row plans are on (``VX_CPU_ROW_PLAN``), once decided; None: not asked yet.
_enabled: bool | None = None


def enabled() -> bool:
    """Whether row plans are on: ``VX_CPU_ROW_PLAN`` at the first ask, kept."""
    global _enabled
    if _enabled is None:
        _enabled = bool(envs.VX_CPU_ROW_PLAN)
    return _enabled


def clear() -> None:
    """Forget every tuned shape, and whether plans are on (tests: as a new process)."""
    global _enabled
    _enabled = None
    _times.clear()
    _plans.clear()
    _vnni_times.clear()
    _vnni_wins.clear()


def _grid_time(times: list[float], m: int) -> float:
    """The measured time of the smallest grid size that holds m rows."""
    return times[(m + GRID_STEP - 1) // GRID_STEP - 1]


def _plan(times: list[float], m: int) -> tuple[int, float]:
    """(rows per call, its estimated time) for an m-row product (m <= the grid's end)."""
    whole = _grid_time(times, m)
    best, best_c = whole, m
    for i, t in enumerate(times):
        c = GRID_STEP * (i + 1)
        if c >= m:
            break
        rest = m % c
        est = (m // c) * t + (_grid_time(times, rest) if rest else 0.0)
        if est < best:
            best, best_c = est, c
    return (best_c, best) if best < MIN_GAIN * whole else (m, whole)


def plan_from_times(times: list[float], m: int) -> int:
    """Rows per call for an m-row product, given one call's time at each grid size.

    Candidates: the whole call, estimated by the grid size at or above m; and for each grid
    size c below m, m // c calls of c rows and one of the rest. Returns m unless the best
    candidate is under MIN_GAIN of the whole call."""
    if m > GRID_STEP * len(times) or m <= GRID_STEP:
        return m
    return _plan(times, m)[0]


def chunk_rows(n: int, k: int, m: int) -> int:
    """Rows per oneDNN call for x [m, k] @ W [n, k].T (m: one call)."""
    key = (n, k, m)
    c = _plans.get(key)
    if c is None:
        times = _times.get((n, k))
        c = plan_from_times(times, m) if times is not None and enabled() else m
        _plans[key] = c
    return c


def tune(linears: list[tuple[torch.Tensor, torch.Tensor | None, int, int]]) -> int:
    """Times each distinct (N, K) of these prepacked (weight, bias, N, K) at every grid size;
    returns the shapes tuned. It runs once, at load."""
    if not enabled():
        return 0
    t0 = time.perf_counter()
    op = torch.ops.mkldnn._linear_pointwise
    sizes = range(GRID_STEP, GRID_MAX + 1, GRID_STEP)
    todo: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for weight, bias, n, k in linears:
        if n * k >= MIN_WEIGHT_ELEMENTS and (n, k) not in _times and (n, k) not in todo:
            todo[(n, k)] = (weight, bias)
    xs = {k: torch.randn(GRID_MAX, k).to(w.dtype) for (_, k), (w, _) in todo.items()}
    for (_, k), (weight, bias) in todo.items():
        for m in sizes:  # oneDNN builds (and caches) a primitive per row count
            op(xs[k][:m], weight, bias, "none", [], "")
    # The best of _REPEATS rounds, each over every shape and size: a slow spell of the
    # machine (a neighbour, page collapsing after the load) then spoils one round, not a plan.
    best = {key: [float("inf")] * len(sizes) for key in todo}
    for _ in range(_REPEATS):
        for (n, k), (weight, bias) in todo.items():
            row = best[(n, k)]
            for i, m in enumerate(sizes):
                t = time.perf_counter()
                op(xs[k][:m], weight, bias, "none", [], "")
                row[i] = min(row[i], time.perf_counter() - t)
    _times.update(best)
    done = len(todo)
    _plans.clear()
    if done:
        split = {
            f"{n}x{k}": [m for m in range(GRID_STEP, GRID_MAX + 1, GRID_STEP)
                         if plan_from_times(t, m) != m]
            for (n, k), t in _times.items()
        }  # fmt: skip
        logger.info(
            "row plan: %d shapes tuned in %.1f s; rows split: %s",
            done, time.perf_counter() - t0,
            {s: f"{r[0]}-{r[-1]} ({len(r)} sizes)" for s, r in split.items() if r} or "none",
        )  # fmt: skip
    return done


def vnni_wins(n: int, k: int, m: int) -> bool:
    """Whether x [m, k] @ W [n, k].T (m past the skinny GEMM's rows) goes to the layer's AMX
    VNNI copy rather than oneDNN: by the two measured times (oneDNN's under its row plan);
    True for a shape or size not measured."""
    key = (n, k, m)
    won = _vnni_wins.get(key)
    if won is None:
        vt, ot = _vnni_times.get((n, k)), _times.get((n, k))
        won = True
        if vt is not None and ot is not None and VNNI_FROM <= m <= VNNI_FROM + GRID_STEP * (len(vt) - 1):
            won = _grid_time(vt, m - VNNI_FROM + GRID_STEP) < _plan(ot, m)[1]
        _vnni_wins[key] = won
    return won


def tune_vnni(linears: list[tuple[object, int, int, int]]) -> int:
    """Times each distinct (N, K) of these (AMX `VnniWeight`, N, K, last row count) at every
    grid size from VNNI_FROM (after `tune`, whose oneDNN times `vnni_wins` weighs them
    against); returns the shapes tuned. It runs once, at load.

    Why: which of the two wins depends on the shape (2-core Sapphire Rapids, SmolLM2: the VNNI
    GEMM for the o and down projections, oneDNN for gate-up), so each shape gets the one this
    timing finds ahead."""
    if not enabled():
        return 0
    todo: dict[tuple[int, int], tuple[object, int]] = {}
    for vnni, n, k, last in linears:
        if n * k >= MIN_WEIGHT_ELEMENTS and (n, k) in _times and (n, k) not in _vnni_times:
            todo.setdefault((n, k), (vnni, min(last, GRID_MAX)))
    if not todo:
        return 0
    t0 = time.perf_counter()
    best: dict[tuple[int, int], list[float]] = {}
    for (n, k), (vnni, last) in todo.items():
        x = torch.randn(last, k).to(torch.bfloat16)
        sizes = range(VNNI_FROM, last + 1, GRID_STEP)
        vnni.apply(x[: sizes[0]], None)  # type: ignore[attr-defined]
        row = best[(n, k)] = [float("inf")] * len(sizes)
        for _ in range(_REPEATS):
            for i, m in enumerate(sizes):
                t = time.perf_counter()
                vnni.apply(x[:m], None)  # type: ignore[attr-defined]
                row[i] = min(row[i], time.perf_counter() - t)
    _vnni_times.update(best)
    _vnni_wins.clear()
    logger.info("AMX VNNI GEMM: %d shapes timed in %.1f s", len(todo), time.perf_counter() - t0)
    return len(todo)
