"""The house rules, checked by import.

- `vx.core` never imports torch (the EngineCore stays a cheap, synchronous process);
- `vx.http` never imports `vx.core` or `vx.gpu` (the front talks to them only over rings);
- no import cycles among vx's modules: no module imports, at any level (a function's lazy
  import and a `TYPE_CHECKING` one included), one that imports it back.

Size is a reviewer's signal, not a rule: no line budget is checked here.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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
    shared = ["vx.messages", "vx.ipc.codec", "vx.config", "vx.sampling_params", "vx"]
    if (PKG / "ipc" / "ring.py").exists():
        shared.append("vx.ipc.ring")
    assert "torch" not in _imported_after(shared)


def _import_graph() -> dict[str, set[str]]:
    """{module: the vx modules it imports anywhere in its source}, by reading the source."""
    modules = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name in a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = _import_graph()
    # `vx` itself re-exports its API (`vx.LLM`): its own imports are not a cycle's edges.
    graph = {m: {t for t in ts if t != "vx"} for m, ts in graph.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_pickle_in_vx() -> None:
    offenders = []
    for path in PKG.rglob("*.py"):
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith(("import pickle", "from pickle", "import cloudpickle")):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
