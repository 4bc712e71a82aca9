"""Huge pages for CPU weights (vx.gpu.cpu.pages): what was asked collapses, the values stay."""

from __future__ import annotations

import platform

import pytest
import torch

from vx.gpu.cpu.pages import collapse_ranges, collapse_weights

pytestmark = pytest.mark.timeout(120)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping holding addr (kB)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_populated_weights_collapse_and_keep_their_values() -> None:
    if platform.system() != "Linux" or _thp_mode() == "never":
        pytest.skip("no transparent huge pages here")
    w = torch.randn(4 << 20)  # 16 MiB, populated
    before = w.clone()
    done = collapse_ranges([(w.data_ptr(), w.numel() * 4)])
    if done == 0:
        pytest.skip("MADV_COLLAPSE declined here (kernel before 6.1, or no huge page free)")
    assert done >= 12 << 20  # every whole 2 MiB page inside the 16 MiB
    assert done % (2 << 20) == 0
    assert _huge_kb(w.data_ptr() + (4 << 20)) >= 2048
    assert torch.equal(w, before)


def test_ranges_shorter_than_a_huge_page_are_left_alone() -> None:
    w = torch.randn(1000)
    assert collapse_ranges([(w.data_ptr(), w.numel() * 4)]) == 0
    assert collapse_ranges([]) == 0


def test_collapse_weights_is_off_with_the_switch(monkeypatch) -> None:
    model = torch.nn.Linear(1024, 1024)
    monkeypatch.setenv("VX_CPU_HUGE_PAGES", "0")
    assert collapse_weights(model) == 0
    monkeypatch.delenv("VX_CPU_HUGE_PAGES")
    assert collapse_weights(model) >= 0  # 4 MiB of weights: 0 or 2 MiB, never an error


def test_kv_cache_is_zeroed_in_huge_pages() -> None:
    """The CPU KV cache asks for 2 MiB pages before it is zeroed (the decode attention's
    scattered block reads), and is still all zeros."""
    from vx.gpu.kv_cache import allocate_kv_caches

    (k, v), = allocate_kv_caches(1, 2048, 3, 64, dtype=torch.bfloat16, device="cpu")  # 12 MiB
    assert not k.any() and not v.any()
    if platform.system() != "Linux" or _thp_mode() == "never":
        pytest.skip("no transparent huge pages here")
    if _huge_kb(k.data_ptr() + (6 << 20)) == 0:
        pytest.skip("no huge page was free for the fault here")
    assert _huge_kb(k.data_ptr() + (6 << 20)) >= 2048


def test_advise_huge_is_off_with_the_switch(monkeypatch) -> None:
    from vx.gpu.cpu.pages import advise_huge

    t = torch.empty(4 << 20)
    monkeypatch.setenv("VX_CPU_HUGE_PAGES", "0")
    assert advise_huge(t) == 0
    monkeypatch.delenv("VX_CPU_HUGE_PAGES")
    assert advise_huge(torch.empty(100)) == 0  # no whole 2 MiB page inside
