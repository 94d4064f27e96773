"""Every command the docs and the records name (``python -m X`` in README.md, docs/, results/, analysis/*.yaml, sweeps/)
still runs: each prints its usage with ``--help`` and exits 0. The docs name each module by its path today. A record
(a file under results/ or sweeps/, docs/evidence.md, analysis/regime.yaml: what was run and pre-registered, never
rewritten) keeps the command it was made with, so a module that moves keeps its old path as a thin stub
(:data:`ALIASES`) exactly while a record names that path, and no longer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "results/README.md", "results/warm_starts/README.md", "Makefile", "docs/**/*.md", "docs/**/*.yaml"]
"""Pages that explain the repo: they name today's paths only."""
RECORDS = [
    "results/*/*.json",
    "results/*/*.jsonl",
    "results/mechanism/*/*.jsonl",
    "results/tables/*.md",
    "sweeps/*.yaml",
    "sweeps/*/*.yaml",
    "docs/evidence.md",
    "analysis/*.yaml",
]
"""Files that record what was run or pre-registered (results/runs/ holds no command): an old path stays while one of
these names it."""
SOURCES = DOCS + RECORDS
COMMAND = re.compile(r"python -m ([A-Za-z_][\w.]*\w)")
ALIASES = {
    "experiments.bench_gpu": "experiments.bench.gpu",  # results/bench_gpu/2026-12-04-nvidia-h200.json
    "experiments.mechanism_trl": "experiments.mechanism.trl",  # results/mechanism/r1/probe_set.jsonl
}
"""Old module path -> where the module lives now; each is a stub of a few lines (its docstring names the record)."""
IMPORT_ALIASES = {"nsr.validate": "nsr.value_checks"}
"""Old paths of library modules (no command): kept because ``nsr`` is a public package."""
NOT_OURS = {"pytest", "verl.trainer.main_ppo"}  # the docs name them; their help is their own (hydra prints no usage)

PROBE = r"""
import contextlib, io, json, runpy, sys
out = {}
for m in sys.argv[1:]:
    sys.argv = [m, "--help"]
    buf = io.StringIO()
    code = None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_module(m, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    out[m] = [code, buf.getvalue()[:2000]]
print(json.dumps(out))
"""


def named_commands(patterns=SOURCES) -> set[str]:
    found = set()
    for pattern in patterns:
        for path in ROOT.glob(pattern):
            found |= set(COMMAND.findall(path.read_text()))
    return found - NOT_OURS


def test_every_named_command_and_every_old_path_prints_its_usage():
    named = named_commands()
    assert {"experiments.run", "slurm.submit", "analysis.make_all", "experiments.mechanism"} <= named  # the scan works
    assert {"devtools.synthetic_runs", "devtools.bench_make_all"} <= named  # developer support, named in docs
    modules = sorted(named | set(ALIASES))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {m: r for m, r in result.items() if r[0] not in (0, None) or not re.search(r"usage|python -m", r[1])}
    assert bad == {}, f"commands that do not print their usage with --help: {bad}"


def test_an_old_path_is_the_module_itself():
    """``import`` of an old path gives the moved module (one object: patching one patches the other)."""
    import importlib

    for old, new in {**ALIASES, **IMPORT_ALIASES}.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_an_old_path_stays_exactly_while_a_record_names_it():
    """Each stub of :data:`ALIASES` is named by a record (else it goes), says so, and is a few lines; the docs name
    the module by its path today, never by an old one."""
    in_records = named_commands(RECORDS)
    assert {"experiments.mechanism", "analysis.mechanism", "experiments.run"} <= in_records  # the scan reads records
    assert sorted(set(ALIASES) - in_records) == [], "old paths no record names (delete them)"
    for old in ALIASES:
        stub = ROOT / (old.replace(".", "/") + ".py")
        text = stub.read_text()
        assert text.startswith('"""Old path of') and "record" in text.split('"""')[1], stub
        assert len(text.splitlines()) <= 12, f"{stub}: a stub, not a module"
    records = {p for pattern in RECORDS for p in ROOT.glob(pattern)}
    pages = sorted({p for pattern in DOCS for p in ROOT.glob(pattern)} - records)
    assert ROOT / "README.md" in pages and ROOT / "docs/drafts/stage_r1.md" in pages
    old = re.compile(r"python -m (" + "|".join(map(re.escape, ALIASES)) + r")(?![\w.])")
    bad = {str(p.relative_to(ROOT)): old.findall(p.read_text()) for p in pages}
    assert {k: v for k, v in bad.items() if v} == {}, "docs that name an old path instead of today's"
