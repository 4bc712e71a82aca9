"""The Worker's settling before its first step (`vx.gpu.worker._settle_for_steps`): on CPU,
glibc's malloc keeps freed memory for the next step instead of unmapping it, and the objects
alive at that point are frozen out of the garbage collector's walks.

Runs in: fresh Python subprocesses (malloc's settings and the gc freeze are process-wide).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = r"""
import gc, os, sys
from vx.gpu.worker import _settle_for_steps

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

_settle_for_steps(sys.argv[1])
frozen = gc.get_freeze_count()
before = rss()
block = bytearray(256 << 20)  # touched: zero-filled by bytearray
grown = rss()
del block
print(frozen, grown - before, rss() - before)
"""


def _probe(device: str, tuning: str) -> tuple[int, int, int]:
    env = dict(os.environ, VX_CPU_MALLOC_TUNING=tuning)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, device], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    frozen, grown, kept = (int(x) for x in out.stdout.split())
    return frozen, grown, kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_cpu_worker_keeps_freed_memory_and_freezes_gc() -> None:
    frozen, grown, kept = _probe("cpu", "1")
    assert frozen > 1000  # vx and its imports, now out of the collector's walks
    assert grown >= 200 << 20
    assert kept >= 200 << 20  # freed, but kept for the next step: no fresh pages to fault in


def test_malloc_left_alone_when_off_or_not_cpu() -> None:
    for device, tuning in (("cpu", "0"), ("cuda:0", "1")):
        frozen, grown, kept = _probe(device, tuning)
        assert frozen > 1000  # the gc freeze applies everywhere
        assert grown >= 200 << 20
        assert kept < 64 << 20  # glibc's default: a block this large is unmapped when freed
