"""The house rules, checked by import and by line count.

- `vx.core` never imports torch (the EngineCore stays a cheap, synchronous process);
- `vx.http` never imports `vx.core` or `vx.gpu` (the front talks to them only over rings);
- every module stays under its line budget (style.md: scheduler.py ~400, others ~500).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "vx"


def _modules(sub: str) -> list[str]:
    return sorted(
        "vx." + ".".join(p.relative_to(PKG).with_suffix("").parts)
        for p in (PKG / sub).rglob("*.py")
        if p.name != "__init__.py"
    )


def _imported_after(modules: list[str]) -> set[str]:
    """Import `modules` in a fresh interpreter and return every module name it loaded."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(out.stdout.split())


def test_core_never_imports_torch() -> None:
    loaded = _imported_after(_modules("core"))
    assert "torch" not in loaded
    assert not any(m.startswith("vx.gpu") or m.startswith("vx.http") for m in loaded)


def test_http_never_imports_core_or_gpu() -> None:
    loaded = _imported_after(_modules("http"))
    bad = sorted(m for m in loaded if m.startswith(("vx.core", "vx.gpu")))
    assert not bad, f"vx.http imported {bad}"
    assert "torch" not in loaded


def test_shared_modules_import_no_torch() -> None:
    shared = ["vx.messages", "vx.codec", "vx.config", "vx.sampling_params", "vx"]
    if (PKG / "ring.py").exists():
        shared.append("vx.ring")
    assert "torch" not in _imported_after(shared)


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_line_budget(path: pathlib.Path) -> None:
    budget = 400 if path.name == "scheduler.py" else 500
    n = len(path.read_text().splitlines())
    assert n <= budget + 25, f"{path.relative_to(ROOT)} has {n} lines (budget {budget})"


def test_no_pickle_in_vx() -> None:
    offenders = []
    for path in PKG.rglob("*.py"):
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith(("import pickle", "from pickle", "import cloudpickle")):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
