"""The import layers of docs/design.md ("Dependencies"), checked on every import of the code, function-local ones
included (a late import is still a dependency): no file imports against the table, and no circle of files exists.

    nsr/          imports only torch, the frameworks it plugs into, and nsr itself
    experiments/  imports nsr/ (and itself)
    slurm/        imports experiments/ and nsr/
    analysis/     imports experiments/ and nsr/
    notebooks/    imports analysis/ (and what analysis may import)
    devtools/     imports analysis/ (and what analysis may import); only the tests import it
    sweeps/       sweep and preset files only (no code)

The table may lose arrows, never gain one. Inside experiments/ three kinds of module (docs/design.md, "Backends"):

    a backend     experiments/<name>/ for each name registered in experiments/backends.py: imports shared modules
                  (and its own folder), never another backend and never a module above the backends
    above         the modules that drive the backends (:data:`ABOVE`: the registry, the CLI, the benchmarks and the
                  paired per-update test, experiments/mechanism/): import anything in experiments/
    shared        every other module (schema, run folders, sweeps, tasks/, models/, sft, evaluation/, rewards/):
                  imports shared modules only

Imports under ``if TYPE_CHECKING:`` count like any other: an annotation-only import still ties two files (a circle
through one is a circle). ``from package import name`` counts as an import of ``package/name.py`` when that file
exists, else of the package's ``__init__.py``. The package's own ``__init__.py`` (``experiments``) is above: it loads
the registry so every RunConfig knows its backend.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from experiments.backends import BACKENDS as REGISTERED

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nsr", "experiments", "slurm", "analysis", "notebooks", "devtools", "sweeps")
ALLOWED = {
    "nsr": {"nsr"},
    "experiments": {"experiments", "nsr"},
    "slurm": {"slurm", "experiments", "nsr"},
    "analysis": {"analysis", "experiments", "nsr"},
    "notebooks": {"notebooks", "analysis", "experiments", "nsr"},
    "devtools": {"devtools", "analysis", "experiments", "nsr"},
    "sweeps": set(),
}
"""Layer -> the layers of this repo its files may import (third-party packages are not constrained here)."""


def _files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py of the repo's layers under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, module: str, files: dict[str, Path]) -> set[str]:
    """The repo modules ``path`` imports, anywhere in the file (module-level, function-local, conditional, under
    ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
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
                found.add(sub if sub in files else base)
    out = set()
    for name in found:
        while name and name not in files:  # `import a.b.c` of a module file: its longest known prefix
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] in PACKAGES:
            out.add(name)
    return out - {module}


def scan(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the repo modules it imports, for every module under ``root``."""
    files = _files(root)
    return {m: _imports(p, m, files) for m, p in files.items()}


FILES = _files()
GRAPH = scan()
BACKENDS = tuple(REGISTERED)
"""The registered backends; each is the folder experiments/<name>/."""
ABOVE = frozenset(
    {
        "experiments",
        "experiments.backends",
        "experiments.run",
        "experiments.mechanism",  # the package: every module in it (the paired per-update test drives the backends)
        "experiments.bench",  # the package: every module in it (benchmarks drive the backends)
        "experiments.mechanism_trl",  # old path of experiments.mechanism.trl (a record names its command)
        "experiments.bench_gpu",  # old path of experiments.bench.gpu (a record names its command)
    }
)
"""Modules of experiments/ above the backends (they drive them), a package standing for every module in it; every
other non-backend module is shared."""
ABOVE_PACKAGES = frozenset({"experiments.mechanism", "experiments.bench"})
"""The packages of :data:`ABOVE` (the package ``experiments`` itself is only its ``__init__``)."""


def kind(module: str, backends=BACKENDS, above=ABOVE) -> str | None:
    """'backend:<name>', 'above' or 'shared' for a module of experiments/; None outside experiments/."""
    parts = module.split(".")
    if parts[0] != "experiments":
        return None
    if module in above or any(module.startswith(f"{p}.") for p in ABOVE_PACKAGES & above):
        return "above"
    if len(parts) > 1 and parts[1] in backends:
        return f"backend:{parts[1]}"
    return "shared"


def inside_violations(graph: dict[str, set[str]], backends=BACKENDS, above=ABOVE) -> list[str]:
    """Imports inside experiments/ against its kinds: a shared module importing a backend or a module above, a
    backend importing another backend or a module above."""
    bad = []
    for m, deps in graph.items():
        km = kind(m, backends, above)
        if km is None or km == "above":
            continue
        for d in deps:
            kd = kind(d, backends, above)
            if kd is None or kd == "shared" or kd == km:
                continue
            bad.append(f"{m} ({km}) imports {d} ({kd})")
    return sorted(bad)


def test_the_scan_sees_late_imports_and_resolves_names():
    """The checker is not vacuous: it finds module-level, function-local and `from pkg import module` imports."""
    assert "experiments.config" in GRAPH["experiments.run"]
    assert "nsr.objectives" in GRAPH["nsr"] and "nsr.theory" in GRAPH["nsr.objectives"]
    assert len(FILES) > 60 and sum(map(len, GRAPH.values())) > 150
    assert "experiments.config" in GRAPH["experiments.models.tiny"]  # an import under TYPE_CHECKING counts
    assert set(BACKENDS) == {"tiny", "openrlhf", "trl"} and all((ROOT / "experiments" / b).is_dir() for b in BACKENDS)
    assert ABOVE <= set(GRAPH)  # every module named above exists
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


def test_inside_experiments_no_shared_module_imports_a_backend():
    assert inside_violations(GRAPH) == [], "imports against the kinds of experiments/:\n" + "\n".join(
        inside_violations(GRAPH)
    )
    shared = [m for m in GRAPH if kind(m) == "shared"]
    assert {"experiments.config", "experiments.sft", "experiments.tasks.countdown", "experiments.models.qwen2"} <= set(
        shared
    )


def units(graph: dict[str, set[str]], package: str = "experiments") -> dict[str, set[str]]:
    """The imports between the rooms of ``package``: each folder of it (``experiments/tasks/``) and each module file
    (``experiments/run.py``) is one unit; unit -> the other units its files import."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m.split(".")[0] != package:
            continue
        out.setdefault(unit(m), set()).update(unit(d) for d in deps if d.split(".")[0] == package)
    return {u: deps - {u} for u, deps in out.items()}


def test_no_import_runs_back_up_inside_experiments():
    """No two folders or modules of experiments/ import each other, through any chain: the rooms stand in one order,
    each importing only rooms below it (a folder importing a module that imports the folder back is a circle here,
    though no two files form one)."""
    assert cycles(units(GRAPH)) == [], "rooms of experiments/ that import each other: " + str(cycles(units(GRAPH)))
    assert {"experiments.tasks", "experiments.models"} <= units(GRAPH).keys()


def _made_up(tmp_path: Path, sources: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in sources.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan(tmp_path)


TC = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {}\n"


def test_a_shared_module_importing_a_backend_under_type_checking_is_caught(tmp_path):
    """A made-up tree: experiments/config.py (shared) imports experiments/tiny/model.py (a backend) for an annotation
    only; the scan sees the import and the rule names it. Its twin without the import passes."""
    graph = _made_up(
        tmp_path,
        {
            "experiments/__init__.py": "",
            "experiments/config.py": TC.format("from experiments.tiny.model import Model"),
            "experiments/tiny/__init__.py": "",
            "experiments/tiny/model.py": "import experiments.config\n",
            "experiments/tasks/__init__.py": "",
            "experiments/tasks/countdown.py": "from experiments import config\n",
        },
    )
    assert graph["experiments.config"] == {"experiments.tiny.model"}
    assert inside_violations(graph, backends=("tiny",), above=frozenset()) == [
        "experiments.config (shared) imports experiments.tiny.model (backend:tiny)"
    ]
    assert cycles(graph) == [["experiments.config", "experiments.tiny.model"]]
    (tmp_path / "experiments/config.py").write_text("")
    assert inside_violations(scan(tmp_path), backends=("tiny",), above=frozenset()) == []


def test_a_backend_importing_another_backend_is_caught(tmp_path):
    graph = _made_up(
        tmp_path,
        {
            "experiments/__init__.py": "",
            "experiments/trl/__init__.py": "",
            "experiments/trl/train.py": "def f():\n    from experiments.tiny.sft import warm_start\n",
            "experiments/tiny/__init__.py": "",
            "experiments/tiny/sft.py": "",
        },
    )
    assert inside_violations(graph, backends=("tiny", "trl"), above=frozenset()) == [
        "experiments.trl.train (backend:trl) imports experiments.tiny.sft (backend:tiny)"
    ]


def test_a_circle_made_only_of_type_checking_imports_is_a_circle(tmp_path):
    graph = _made_up(
        tmp_path,
        {
            "nsr/__init__.py": "",
            "nsr/a.py": TC.format("from nsr.b import B"),
            "nsr/b.py": TC.format("import nsr.c"),
            "nsr/c.py": TC.format("from nsr import a"),
        },
    )
    assert graph["nsr.a"] == {"nsr.b"} and graph["nsr.b"] == {"nsr.c"} and graph["nsr.c"] == {"nsr.a"}
    assert cycles(graph) == [["nsr.a", "nsr.b", "nsr.c"]]


def test_two_folders_importing_each_other_through_different_files_is_caught(tmp_path):
    """A made-up tree: models/tiny.py imports tasks/countdown.py and tasks/arithmetic.py imports models/big.py. No
    circle of files, but the two folders import each other: the rooms' check names them."""
    graph = _made_up(
        tmp_path,
        {
            "experiments/__init__.py": "",
            "experiments/models/__init__.py": "",
            "experiments/models/tiny.py": "from experiments.tasks.countdown import EOS\n",
            "experiments/models/big.py": "",
            "experiments/tasks/__init__.py": "",
            "experiments/tasks/countdown.py": "EOS = 0\n",
            "experiments/tasks/arithmetic.py": "def f():\n    from experiments.models.big import load\n",
        },
    )
    assert cycles(graph) == []
    assert cycles(units(graph)) == [["experiments.models", "experiments.tasks"]]
    (tmp_path / "experiments/tasks/arithmetic.py").write_text("")
    assert cycles(units(scan(tmp_path))) == []
