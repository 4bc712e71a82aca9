"""The environment registry (`vx.envs`): vx reads the environment only through it, every `VX_*`
name the repository mentions is declared there, and docs/configuration.md is its text."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from vx import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "vx"

# Files under vx/ allowed to read the environment themselves.
READERS_ALLOWED = {"vx/envs.py"}

_NAME = re.compile(r"\bVX_[A-Z0-9_]*[A-Z0-9]\b")
_C_MACRO = re.compile(r"#\s*(?:define|undef|ifdef|ifndef)\s+(VX_[A-Z0-9_]+)")


def _is_environ(node: ast.AST) -> bool:
    """`os.environ`, or a bare `environ` (imported from os)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def environment_reads(source: str) -> list[int]:
    """Line numbers where `source` reads the environment: `os.environ.get(...)`,
    `os.environ[...]` as a value, `... in os.environ`, `os.getenv(...)`, `from os import
    getenv/environ`. Writes (`os.environ[k] = v`, `.pop`) and copies for a child's environment
    (`dict(os.environ, ...)`, `{**os.environ}`) are not reads of a setting."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in ("get", "setdefault") and _is_environ(f.value):
                lines.append(node.lineno)
            elif f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_environ(c) for c in node.comparators):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv") for a in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_scanner_sees_every_kind_of_read() -> None:
    src = (
        "import os\n"
        "a = os.environ.get('X')\n"
        "b = os.environ['X']\n"
        "c = os.getenv('X')\n"
        "d = 'X' in os.environ\n"
        "os.environ['X'] = '1'\n"  # a write
        "e = dict(os.environ, X='1')\n"  # a child's environment
        "from os import environ\n"
    )
    assert environment_reads(src) == [2, 3, 4, 5, 8]


def test_vx_reads_the_environment_only_through_envs() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in READERS_ALLOWED:
            continue
        bad += [f"{rel}:{n}" for n in environment_reads(path.read_text())]
    assert not bad, f"read these through vx.envs (declare them there): {bad}"


def _mentioning_files() -> list[pathlib.Path]:
    return [
        *PKG.rglob("*.py"),
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(p for p in (ROOT / "bench").rglob("*") if p.suffix in (".py", ".sh")),
        *(ROOT / "tests").rglob("*.py"),
    ]


def _c_macros() -> set[str]:
    """`VX_*` names the C kernel sources define: macros, not environment variables."""
    sources = [p for p in PKG.rglob("*") if p.suffix in (".c", ".h", ".py")]
    return {m for p in sources for m in _C_MACRO.findall(p.read_text())}


def test_every_vx_name_mentioned_is_declared() -> None:
    macros = _c_macros()
    undeclared: dict[str, list[str]] = {}
    for path in _mentioning_files():
        for name in set(_NAME.findall(path.read_text())):
            if name not in envs.ENV_VARS and name not in macros:
                undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"declare these in vx/envs.py (or remove them): {undeclared}"


def test_no_macro_shadows_a_variable() -> None:
    assert not _c_macros() & set(envs.ENV_VARS)


def test_every_declared_variable_is_read_somewhere() -> None:
    """No entry outlives its reader: a vx variable appears in vx/ outside envs.py, a tests' or
    bench's one in the files it names."""
    vx_text = "\n".join(p.read_text() for p in PKG.rglob("*.py") if p.name != "envs.py")
    for var in envs.ENV_VARS.values():
        if var.read_in == "vx":
            assert var.name in vx_text, f"{var.name}: no code under vx/ reads it"
        else:
            for rel in var.read_in.split(", "):
                assert var.name in (ROOT / rel).read_text(), f"{var.name}: not in {rel}"


def test_entries_are_complete() -> None:
    for name, var in envs.ENV_VARS.items():
        assert name == var.name
        assert var.doc and "\n" not in var.doc and var.set_by and var.shown_default, name
        if var.read_in == "vx":  # a name vx reads is vx's own unless marked external
            assert var.external == (not name.startswith("VX_")), name


def test_reads_happen_at_access_time(monkeypatch) -> None:
    monkeypatch.delenv("VX_CPU_COMPACT", raising=False)
    assert envs.VX_CPU_COMPACT is True
    monkeypatch.setenv("VX_CPU_COMPACT", "0")
    assert envs.VX_CPU_COMPACT is False
    monkeypatch.setenv("VX_CPU_COMPACT", "yes")  # a switch is on unless "0"
    assert envs.VX_CPU_COMPACT is True
    monkeypatch.setenv("VX_CPU_EMULATE", "true")  # a flag is on only at "1"
    assert envs.VX_CPU_EMULATE is False
    monkeypatch.setenv("VX_QUANT_MAX_ROWS", "")
    assert envs.VX_QUANT_MAX_ROWS is None
    monkeypatch.setenv("VX_CPU_SPLIT_MIN_ROWS", "3")
    assert envs.VX_CPU_SPLIT_MIN_ROWS == 3
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    assert envs.HF_HUB_OFFLINE is True


def test_cache_default_follows_home(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("VX_CACHE", raising=False)
    assert envs.VX_CACHE == str(tmp_path / ".cache" / "vx")
    monkeypatch.setenv("VX_CACHE", "")  # empty: the default, as before the registry
    assert envs.VX_CACHE == str(tmp_path / ".cache" / "vx")
    monkeypatch.setenv("VX_CACHE", "/x")
    assert envs.VX_CACHE == "/x"


def test_an_undeclared_name_is_an_error() -> None:
    with pytest.raises(AttributeError):
        getattr(envs, "VX_" + "UNDECLARED")  # spelt in two, or the scan above would see it


def test_configuration_md_is_the_registry() -> None:
    checked_in = (ROOT / "docs" / "configuration.md").read_text()
    assert checked_in == envs.markdown(), (
        "docs/configuration.md is stale: python -m vx.envs --markdown > docs/configuration.md"
    )
