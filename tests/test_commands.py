"""Every command the records and docs name (``python -m X`` in README.md, docs/, results/README.md, analysis/*.yaml,
sweeps/) still runs: each prints its usage with ``--help`` and exits 0. analysis/regime.yaml and the pre-registered
plans are records and are never edited, so a module that moves keeps its old path as an alias (:data:`ALIASES`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    "README.md",
    "results/README.md",
    "Makefile",
    "docs/*.md",
    "analysis/*.yaml",
    "sweeps/*.yaml",
    "sweeps/*/*.yaml",
]
COMMAND = re.compile(r"python -m ([A-Za-z_][\w.]*\w)")
ALIASES = {
    "experiments.tiny.sft": "experiments.sft",
    "experiments.openrlhf.evaluate": "experiments.evaluation.math",
    "experiments.bench_batch": "experiments.bench.batch",
    "experiments.bench_gpu": "experiments.bench.gpu",
    "experiments.bench_loss": "experiments.bench.loss",
    "experiments.verl": "experiments.verl_overrides",
    "experiments.mechanism": "experiments.mechanism_probe",
    "analysis.mechanism": "analysis.mechanism_stats",
}
"""Old module path -> where the module lives now."""
IMPORT_ALIASES = {"nsr.validate": "nsr.value_checks"}
"""Old paths of library modules (no command): kept because ``nsr`` is a public package."""
NOT_OURS = {"pytest"}

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


def named_commands() -> set[str]:
    found = set()
    for pattern in SOURCES:
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
    """``import`` of an old path gives the moved module (one object: patching one patches the other), or, for an old
    path kept as a package (its ``__main__`` runs the command), a package whose attributes are the module's."""
    import importlib

    for old, new in {**ALIASES, **IMPORT_ALIASES}.items():
        was, now = importlib.import_module(old), importlib.import_module(new)
        assert was is now or (hasattr(was, "__path__") and was.main is now.main), old
