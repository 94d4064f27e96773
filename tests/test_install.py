"""The repo is an installed package (``pip install -e .``, done by ``make venv``): its packages import, and its
sweep files and presets (data next to the packages, in sweeps/) are found from any working directory with no
PYTHONPATH.

Each check runs a fresh interpreter in isolated mode (``-I``: no PYTHONPATH, no user site, no current directory
on ``sys.path``) whose working directory is outside the repo, so only the installed package can answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("nsr", "experiments", "analysis", "slurm")

CHILD = r"""
import importlib, json, sys
from importlib.resources import files
out = {"path": sys.path}
for name in %r:
    out[name] = importlib.import_module(name).__file__
from experiments import sweep
out["delta"] = str(sweep.sweep_path("delta"))
out["preset"] = str(sweep.preset_file("tiny-smoke"))
out["sweep_files"] = sorted(p.name for p in sweep.SWEEPS_DIR.glob("*.yaml"))
out["claims"] = (files("analysis") / "claims.yaml").is_file()
out["site"] = (files("slurm") / "cluster.yaml").is_file()
print(json.dumps(out))
"""


def _isolated(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-I", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_packages_import_from_outside_the_repo(tmp_path):
    assert not tmp_path.resolve().is_relative_to(REPO)
    proc = _isolated(["-c", CHILD % (PACKAGES,)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert str(REPO) not in out["path"] and "" not in out["path"]  # nothing put the repo on sys.path
    for name in PACKAGES:  # editable install: the modules are the repo's own files
        assert Path(out[name]) == REPO / name / "__init__.py", (name, out[name])
    assert out["delta"] == str(REPO / "sweeps" / "delta.yaml")
    assert Path(out["preset"]).is_file()
    assert out["sweep_files"] == sorted(p.name for p in (REPO / "sweeps").glob("*.yaml")) and out["sweep_files"]
    assert out["claims"] and out["site"]


def test_a_sweep_expands_by_name_from_outside_the_repo(tmp_path):
    """``slurm.submit`` resolves a sweep name through the package and validates every run (no torch work)."""
    from experiments.sweep import expand

    proc = _isolated(["-m", "slurm.submit", "delta", "--preset", "tiny-smoke", "--dry-run"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_ids = [spec.run_id for spec in expand("delta", preset="tiny-smoke")]
    assert run_ids and all(run_id in proc.stdout for run_id in run_ids)
    assert not any(tmp_path.iterdir())  # a dry run writes nothing, here either
