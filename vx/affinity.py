"""Which cores vx's host processes (the front and the EngineCores) run on, on a CPU run.

Runs in: the front (once it has spawned the engine processes, so the Workers keep every core)
and each EngineCore (at start).

Why: on CPU the Worker's OpenMP threads take every core. The host processes wake in bursts
(each step's tokens: detokenizing, one SSE write per stream, the next schedule), each on
whichever core the kernel picks, and preempt the Worker thread there and evict its L1/L2
(prefetched K/V, packed activations). Pinned to one core, they disturb one Worker thread
only; the work sharing of `vx/gpu/cpu/csrc/parallel.c` lets the other thread take over what
the disturbed one has not started.

``VX_HOST_CPUS``: ``auto`` (the default: the last allowed core, on CPU runs with two or more
cores allowed; GPU runs are left alone), ``off``, or a list such as ``3`` or ``2,5-7``.
"""

from __future__ import annotations

import logging
import os

from vx import envs

logger = logging.getLogger(__name__)


def host_cpus(device: str, spec: str | None = None) -> set[int] | None:
    """The cores the host processes should run on, or None to leave them where they are."""
    spec = (envs.VX_HOST_CPUS if spec is None else spec).strip().lower()
    if spec in ("", "off", "none"):
        return None
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return None
    if spec == "auto":
        return {max(allowed)} if device == "cpu" and len(allowed) >= 2 else None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        logger.warning("VX_HOST_CPUS=%r is not a list of cores; not pinning", spec)
        return None
    return (cpus & allowed) or None


def pin_host_process(device: str) -> None:
    """Pin every thread of this process to `host_cpus(device)` (no-op where that is None)."""
    cpus = host_cpus(device)
    if not cpus:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that has just exited
            pass
    logger.debug("pinned to cores %s", sorted(cpus))
