"""The package's shape: no import cycle at any depth, small modules, a short top level.

Imports are read from the source (every ``import`` statement, at module level or inside a
function), so a cycle hidden behind a function-level import is found too. ``from P import
name`` depends on ``P.name`` when that is a module and on ``P`` otherwise; ``import P.Q``
depends on ``P.Q``.
"""

from __future__ import annotations

import pytest

import ast
import pathlib

import dask_ipar

pytestmark = pytest.mark.fast  # no cluster: graphs, kernels and formulas only

ROOT = pathlib.Path(dask_ipar.__file__).parent
MAX_LINES = 500
MAX_TOP_LEVEL = 14


def _module_name(path: pathlib.Path) -> str:
    parts = ("dask_ipar", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dask_ipar")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("dask_ipar"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m in modules and m != name}


def _graph():
    modules = _sources()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_at_any_depth():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_read():
    graph = _graph()
    # the checkpoint tasks import the device copies inside functions (workers only)
    assert "dask_ipar.kernels.blocks" in graph["dask_ipar.io.checkpoint_tasks"]
    # ... and only there: the edge above comes from an indented (function-level) import
    lines = _sources()["dask_ipar.io.checkpoint_tasks"].read_text().splitlines()
    uses = [ln for ln in lines if "dask_ipar.kernels.blocks import" in ln]
    assert uses and all(ln.startswith(" ") for ln in uses)


def test_no_module_is_over_500_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in _sources().items()}
    over = {n: k for n, k in long.items() if k > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_at_most_14_modules_at_the_top_level():
    top = sorted(p.name for p in ROOT.iterdir()
                 if (p.suffix == ".py" and p.name != "__init__.py")
                 or (p.is_dir() and (p / "__init__.py").exists()))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_the_cost_model_imports_no_dask():
    graph = _graph()
    for name, path in _sources().items():
        if not name.startswith("dask_ipar.cost"):
            continue
        heavy = [m for m in _external(path) if m.split(".")[0] in ("dask", "distributed")]
        assert not heavy, f"{name} imports {heavy}"
        bad = [m for m in graph[name] if not m.startswith(("dask_ipar.cost", "dask_ipar.layout"))]
        assert not bad, f"{name} imports {bad}; the cost model may use only cost/ and layout/"
    for name in ("dask_ipar.layout.grid", "dask_ipar.layout.halo", "dask_ipar.layout.partition"):
        assert not [m for m in _external(_sources()[name]) if m.split(".")[0] in ("dask", "distributed")]


def _external(path):
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out
