"""Huge pages for a CPU model's weights (and its KV cache: `advise_huge`).

Runs in: each Worker process on CPU, once after the model is loaded (`ModelRunner.load_model`),
before the KV cache is allocated.

Why: a decode step at small batch streams every weight once (SmolLM2 bf16: 268 MB a step).
Where transparent huge pages are `madvise` only (a common default), the weights sit in 4 KiB
pages and such a step takes ~65,000 TLB misses. `MADV_COLLAPSE` (Linux 6.1+) moves the
populated ranges into 2 MiB pages at once. In a C harness of SmolLM2's 120 GEMVs (2-core AMD
EPYC) the weights streamed faster from 2 MiB pages than from 4 KiB ones.

Invariants: only 2 MiB-aligned ranges that lie wholly inside the weights' spans (the spans of
tensors at most 1 MiB apart, so what lies between is other loaded state) are touched; the KV
cache does not exist yet, so none of its unpopulated pages can be faulted in. Best effort: a
kernel without `MADV_COLLAPSE`, THP switched off, or no huge page free leaves the pages as
they were. `VX_CPU_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from vx import envs

logger = logging.getLogger(__name__)

__all__ = ["advise_huge", "collapse_ranges", "collapse_weights"]

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE = 2 << 20
_MAX_GAP = 1 << 20


def _madvise():
    name = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(name, use_errno=True), "madvise", None) if name else None
    except OSError:
        return None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def collapse_ranges(ranges: list[tuple[int, int]]) -> int:
    """Bytes moved into 2 MiB pages for these (address, length) ranges (merged first)."""
    madvise = _madvise()
    if madvise is None or not ranges:
        return 0
    spans: list[list[int]] = []
    for start, length in sorted(ranges):
        if spans and start - spans[-1][1] <= _MAX_GAP:
            spans[-1][1] = max(spans[-1][1], start + length)
        else:
            spans.append([start, start + length])
    done = 0
    for start, end in spans:
        a, b = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
        if b - a < _HUGE:
            continue
        madvise(a, b - a, _MADV_HUGEPAGE)  # later faults in the range take huge pages too
        if madvise(a, b - a, _MADV_COLLAPSE) == 0:
            done += b - a
        else:
            logger.debug("MADV_COLLAPSE declined (errno %d)", ctypes.get_errno())
    return done


def advise_huge(t: torch.Tensor) -> int:
    """Asks for 2 MiB pages under a CPU tensor not yet touched (the KV cache, before it is
    zeroed): later faults in its 2 MiB-aligned interior take huge pages. Returns the bytes
    advised (0: off, refused, or too small). `VX_CPU_HUGE_PAGES=0` turns it off."""
    if not envs.VX_CPU_HUGE_PAGES or t.device.type != "cpu":
        return 0
    madvise = _madvise()
    start = t.untyped_storage().data_ptr()
    a = -(-start // _HUGE) * _HUGE
    b = (start + t.untyped_storage().nbytes()) // _HUGE * _HUGE
    if madvise is None or b - a < _HUGE or madvise(a, b - a, _MADV_HUGEPAGE) != 0:
        return 0
    return b - a


def collapse_weights(model: torch.nn.Module) -> int:
    """Moves the CPU model's weights (parameters, buffers, fp32 copies, VNNI-packed copies)
    into huge pages."""
    if not envs.VX_CPU_HUGE_PAGES:
        return 0
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        wide = getattr(module, "wide", None)
        if wide is not None:
            tensors.append(wide.weight)
        # the VNNI GEMMs' copies, which the linears read at every row count where they exist
        # (4 KiB pages: a one-row step ran ~12% longer on them, 2-core Sapphire Rapids, AMX off)
        vnni = getattr(module, "vnni", None)
        if vnni is not None:
            tensors.append(vnni.packed)
        for t in tensors:
            if t.device.type != "cpu" or t.is_mkldnn:
                continue
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    done = collapse_ranges([(p, n) for p, n in seen.items() if p])
    if done:
        logger.info("weights in 2 MiB pages: %.0f MB", done / 1e6)
    return done
