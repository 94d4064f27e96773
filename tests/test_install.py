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

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # make test-fast skips it (subprocesses)
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


# ---------------------------------------------------------------- the method library alone (nsr/pyproject.toml)
HARNESS_ONLY = ("pandas", "matplotlib", "scipy", "submitit", "pyarrow", "yaml", "tqdm", "numpy")
"""Import names of the harness's requirements (pyproject.toml) that the method library must not bring."""


def _closure(names: list[str]) -> set[str]:
    """The installed distributions ``names`` need, transitively (this venv's metadata, markers evaluated, no extras)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in metadata.distribution(name).requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return seen


def _link_dists(names: set[str], folder: Path) -> None:
    """Symlink into ``folder`` every top-level file and folder of the installed distributions ``names`` (from their
    RECORD), so a .pth line pointing at ``folder`` makes exactly these importable and visible to pip."""
    from importlib import metadata

    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        dist = metadata.distribution(name)
        site = Path(dist.locate_file(""))
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or top.endswith(".pth"):
                continue
            if not (folder / top).exists():
                (folder / top).symlink_to(site / top)


CHILD_METHOD = r"""
import importlib.metadata as md, importlib.util, json, sys, torch
import nsr
from nsr.premise import PremiseMeter, rates
g = torch.Generator().manual_seed(0)
logp = torch.randn(4, 6, generator=g).clamp(max=-0.1)
old = logp + 0.3 * torch.randn(4, 6, generator=g)
lp = logp.clone().requires_grad_()
adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
mask = torch.ones(4, 6, dtype=torch.bool)
cfg = nsr.LossConfig(rule="nsr", delta=0.2)
loss, met = nsr.policy_loss(lp, old, adv, mask, cfg, generator=g)
meter = PremiseMeter(cfg)
meter.add(loss, lp, adv, mask, old_log_probs=old)
nsr.aggregate(loss, mask).backward()
print(json.dumps({
    "nsr": nsr.__file__, "clip_frac": float(met["clip_frac"]), "grad": float(lp.grad.abs().sum()),
    "premise": sorted(rates(meter.counts(), meter.tokens)), "row": sorted(meter.row(1)),
    "absent": [m for m in %r if importlib.util.find_spec(m) is None],
    "dists": sorted(d.metadata["Name"].lower() for d in md.distributions()),
}))
"""


@pytest.fixture(scope="module")
def method_wheel(tmp_path_factory) -> Path:
    """nsr/ copied alone out of the repo and built into a wheel (no index: this venv's setuptools)."""
    import shutil

    tmp = tmp_path_factory.mktemp("method")
    src = tmp / "nsr"
    shutil.copytree(REPO / "nsr", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w",
         str(tmp / "wheels")], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp / "wheels").glob("nsr_method-*.whl")
    return wheel


def test_method_metadata_requires_torch_only_and_frameworks_as_extras(method_wheel):
    """The wheel's own METADATA: torch is its only requirement; each extra pulls its framework and nothing else; the
    harness (nsr-repro) requires it."""
    import tomllib
    import zipfile

    with zipfile.ZipFile(method_wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
        files = z.namelist()
    requires = sorted(x.split(": ", 1)[1] for x in lines if x.startswith("Requires-Dist: "))
    assert requires == ['openrlhf==0.11.2; extra == "openrlhf"', "torch", 'trl==1.16.0; extra == "trl"',
                        'verl==0.9.1; extra == "verl"']  # fmt: skip
    assert {"nsr/__init__.py", "nsr/trl/trainer.py", "nsr/verl/plugin.py", "nsr/openrlhf/launch.py"} <= set(files)
    assert not any(n.startswith(("experiments/", "analysis/", "slurm/")) for n in files)
    harness = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "nsr-method==0.1.0" in harness


def test_method_installs_alone_into_a_venv_with_only_torch(method_wheel, tmp_path):
    """A fresh virtualenv (no system site-packages) that sees only torch and torch's own requirements (linked from
    this venv through a .pth); pip installs the wheel with no index, so nothing else can come in. Then: ``import
    nsr``, a policy_loss call with its backward, the premise meter work; pandas, matplotlib, scipy, submitit (and the
    harness's other requirements) are absent, and the venv holds exactly torch's closure plus nsr-method. With the
    [trl] extra (TRL's own requirement closure linked the same way) ``from nsr.trl import NSRGRPOTrainer`` works."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert purelib != sysconfig.get_path("purelib")
    torch_only = _closure(["torch"])
    _link_dists(torch_only, tmp_path / "torch-only")
    (Path(purelib) / "torch-only.pth").write_text(f"{tmp_path / 'torch-only'}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "PIP_INDEX_URL")}

    def pip(*args):
        return subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", *args],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # fmt: skip

    proc = pip(str(method_wheel))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    proc = subprocess.run([str(py), "-I", "-c", CHILD_METHOD % (HARNESS_ONLY,)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["nsr"]).is_relative_to(purelib)  # the installed copy, not the repo's
    assert 0 < out["clip_frac"] < 1 and out["grad"] > 0
    assert out["premise"] == sorted(["pos_clipped_zone", "pos_clipped_deep", "pos_rescued", "pos_weight",
                                     "neg_clipped_zone", "neg_clipped_deep", "neg_rescued", "neg_weight"])  # fmt: skip
    assert "pos_clipped" in out["row"]
    assert out["absent"] == list(HARNESS_ONLY)
    from packaging.utils import canonicalize_name

    assert {canonicalize_name(d) for d in out["dists"]} == torch_only | {"nsr-method"}

    trl = _closure(["trl"]) - torch_only
    _link_dists(trl, tmp_path / "trl")
    (Path(purelib) / "trl.pth").write_text(f"{tmp_path / 'trl'}\n")
    proc = pip("--find-links", str(method_wheel.parent), "nsr-method[trl]")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    code = "from nsr.trl import NSRGRPOTrainer, TRL_VERSION; import trl; print(trl.__version__, TRL_VERSION)"
    proc = subprocess.run([str(py), "-I", "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["1.16.0", "1.16.0"]
