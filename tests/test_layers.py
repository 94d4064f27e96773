"""The import layers of docs/design.md ("Dependencies"), checked on every import of the code, function-local ones
included (a late import is still a dependency): no file imports against the table, and no circle of files exists.

    nsr/          imports only torch, the frameworks it plugs into, and nsr itself
    experiments/  imports nsr/ (and itself)
    slurm/        imports experiments/ and nsr/
    analysis/     imports experiments/ and nsr/
    notebooks/    imports analysis/ (and what analysis may import)
    sweeps/       sweep and preset files only (no code)

The table may lose arrows, never gain one. Imports under ``if TYPE_CHECKING:`` are for annotations only and do not
run, so they are not counted. ``from package import name`` counts as an import of ``package/name.py`` when that file
exists, else of the package's ``__init__.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nsr", "experiments", "slurm", "analysis", "notebooks", "sweeps")
ALLOWED = {
    "nsr": {"nsr"},
    "experiments": {"experiments", "nsr"},
    "slurm": {"slurm", "experiments", "nsr"},
    "analysis": {"analysis", "experiments", "nsr"},
    "notebooks": {"notebooks", "analysis", "experiments", "nsr"},
    "sweeps": set(),
}
"""Layer -> the layers of this repo its files may import (third-party packages are not constrained here)."""


def _files() -> dict[str, Path]:
    """Module name -> file, for every .py of the repo's layers."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


FILES = _files()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str) -> set[str]:
    """The repo modules ``path`` imports, anywhere in the file (module-level, function-local, conditional)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in FILES else base)
    out = set()
    for name in found:
        while name and name not in FILES:  # `import a.b.c` of a module file: its longest known prefix
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] in PACKAGES:
            out.add(name)
    return out - {module}


GRAPH = {m: _imports(p, m) for m, p in FILES.items()}


def test_the_scan_sees_late_imports_and_resolves_names():
    """The checker is not vacuous: it finds module-level, function-local and `from pkg import module` imports."""
    assert "experiments.config" in GRAPH["experiments.run"]
    assert "nsr.objectives" in GRAPH["nsr"] and "nsr.theory" in GRAPH["nsr.objectives"]
    assert len(FILES) > 60 and sum(map(len, GRAPH.values())) > 150
    probe = ast.parse("def f():\n    from analysis.stats import interval\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(probe))


@pytest.mark.parametrize("layer", [p for p in PACKAGES if (ROOT / p).is_dir()])
def test_no_import_against_the_layers(layer):
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        if m.split(".")[0] == layer
        for d in deps
        if d.split(".")[0] not in ALLOWED[layer]
    )
    assert bad == [], "imports against docs/design.md's layers:\n" + "\n".join(bad)


def test_sweeps_holds_no_code():
    assert not list((ROOT / "sweeps").rglob("*.py")), "sweeps/ holds sweep and preset files only"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_circle_of_files():
    assert cycles(GRAPH) == []
