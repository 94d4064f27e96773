"""Run identity covers what a run's outputs depend on, and nothing else (experiments.config.IDENTITY).

On the tiny backend: every config field read during a run is in the identity; changing every field outside it leaves
the outputs byte-identical; changing one inside it changes them. Committed run folders keep counting: their identity
is recomputed from their stored config (folder names keep the suffix they were made with).
"""

import dataclasses
import gzip
import json
import typing
from pathlib import Path

import pytest
import yaml

from experiments.config import IDENTITY, NEUTRAL, RunConfig, from_dict, load_config, project, scheme1_hash
from experiments.run import check_folder
from experiments.rundir import REPO_ROOT, RUNS_ROOT, RunDir, RunExistsError, runs_by_hash, stored_identity
from experiments.tiny.train import train

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
SHORT = ["train.steps=4", "eval.every=2", "eval.n_prompts=16", "logging.checkpoint_every=2", "loss.rule=nsr"]
PROPERTIES = {"loss.low": "loss.eps_low", "loss.high": "loss.eps_high"}
"""Properties of a section, and the field each one reads."""


class Reads:
    """A read-only stand-in for a config (or one of its sections) that records every field read through it.

    ``isinstance`` sees the wrapped class (so nsr's type checks pass); a method call other than the identity's own is
    recorded as ``<path>()``, which no identity table allows.
    """

    def __init__(self, obj, prefix: str, log: set):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_log", log)

    @property
    def __class__(self):
        return type(self._obj)

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        if name.startswith("__"):  # dataclasses.fields() reads __dataclass_fields__
            return value
        path = self._prefix + name
        if dataclasses.is_dataclass(value):
            return Reads(value, path + ".", self._log)
        if callable(value):
            if name not in ("run_hash", "identity"):  # both read exactly the identity
                self._log.add(path + "()")
            return value
        self._log.add(PROPERTIES.get(path, path))
        return value

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(name)


def leaves(cls=RunConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name]


def identity_leaves(cfg: RunConfig) -> set[str]:
    def walk(d, prefix=""):
        for k, v in d.items():
            yield from walk(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    return set(walk(project(cfg.to_dict(), IDENTITY[cfg.backend])))


def other_value(key: str, tp, value):
    """A valid value of field ``key`` (type ``tp``) other than ``value``."""
    special = {"openrlhf.zero_stage": 3, "openrlhf.lr_scheduler": "cosine_with_min_lr", "task.chat_template": False}
    if key in special:
        return special[key]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return next(a for a in typing.get_args(tp) if a != value)
    if origin is tuple:
        return ["aime24"] if typing.get_args(tp)[0] is str else value
    if tp is bool:
        return not value
    if tp is int:
        return value + 1
    if tp is float:
        return value / 2
    if tp is str:
        return value + "x" if value else "elsewhere.jsonl"
    raise AssertionError(f"no other value for {key}: {tp}")


def outputs(rd: RunDir) -> dict[str, bytes]:
    """Every output file of a finished tiny run, metrics without the one nondeterministic field (wall_s)."""
    rows = [json.loads(line) for line in rd.metrics_path.read_text().splitlines()]
    out = {"metrics.jsonl": json.dumps([{k: v for k, v in r.items() if k != "wall_s"} for r in rows]).encode()}
    for name in ("eval.jsonl.gz", "ratio_bins.jsonl.gz"):
        out[name] = gzip.decompress((rd.path / name).read_bytes())
    out["files"] = " ".join(sorted(p.name for p in rd.path.iterdir())).encode()
    return out


def run_tiny(cfg, folder) -> RunDir:
    rd = RunDir(folder)
    rd.path.mkdir(parents=True)
    train(cfg, rd, progress=False)
    return rd


@pytest.fixture(scope="module")
def base_run(run_env, tmp_path_factory):
    """The short nsr run, trained through a recorder: (config, its outputs, the fields read)."""
    cfg = load_config(SMOKE, SHORT)
    log: set[str] = set()
    rd = run_tiny(Reads(cfg, "", log), tmp_path_factory.mktemp("base") / "run")
    return cfg, outputs(rd), log


def test_every_field_a_tiny_run_reads_is_in_its_identity(base_run):
    cfg, _, read = base_run
    assert {"seed", "loss.rule", "loss.delta", "rollout.temperature", "eval.seed", "sft.seed"} <= read  # it records
    assert read - identity_leaves(cfg) <= set(NEUTRAL)  # read, and shown not to change outputs (next test)


def test_fields_outside_the_identity_do_not_change_a_tiny_run(base_run, tmp_path):
    cfg, base, _ = base_run
    inside = identity_leaves(cfg)
    data = cfg.to_dict()
    changed = []
    for key, tp in leaves():
        if key in inside:
            continue
        section, leaf = key.split(".")
        data[section][leaf] = other_value(key, tp, data[section][leaf])
        changed.append(key)
    assert {"openrlhf.nodes", "trl.use_vllm", "task.train_data", "logging.checkpoint_every"} <= set(changed)
    other = from_dict(data)
    assert all(other.to_dict()[k.split(".")[0]] != cfg.to_dict()[k.split(".")[0]] for k in changed)
    assert other.run_hash() == cfg.run_hash()
    assert outputs(run_tiny(other, tmp_path / "run")) == base


def test_a_field_inside_the_identity_changes_the_run_and_its_hash(base_run, tmp_path):
    cfg, base, _ = base_run
    other = load_config(SMOKE, [*SHORT, "eval.seed=7"])
    assert other.run_hash() != cfg.run_hash()
    new = outputs(run_tiny(other, tmp_path / "run"))
    assert new["metrics.jsonl"] == base["metrics.jsonl"]  # the eval seed changes the evaluation only
    assert new["eval.jsonl.gz"] != base["eval.jsonl.gz"]


def test_each_backend_leaves_out_the_others_sections():
    tiny = load_config(SMOKE)
    assert {"openrlhf", "trl"}.isdisjoint(tiny.identity()) and tiny.identity()["task"] == {"name": "countdown3"}
    assert "allow_on_policy" not in tiny.identity()["train"]
    cluster = load_config(REPO_ROOT / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml")
    assert "sft" not in cluster.identity() and cluster.identity()["model"]["name"] == cluster.model.name
    assert cluster.replace(trl=dataclasses.replace(cluster.trl, use_vllm=True)).run_hash() == cluster.run_hash()
    assert cluster.replace(sft=dataclasses.replace(cluster.sft, steps=1)).run_hash() == cluster.run_hash()
    assert cluster.replace(seed=1).run_hash() != cluster.run_hash()


def test_a_folder_made_under_the_old_identity_is_found_by_its_config(tmp_path):
    """Scheme 1 hashed every field but logging; such a folder keeps its name, and lookups recompute its identity."""
    cfg = load_config(SMOKE)
    rd = RunDir(tmp_path / "sweep" / f"hard-s0-{scheme1_hash(cfg)}")
    rd.write_config(cfg)
    data = yaml.safe_load(rd.config_path.read_text())
    data["meta"].pop("identity")
    data["meta"]["run_hash"] = scheme1_hash(cfg)
    rd.config_path.write_text(yaml.safe_dump(data))
    assert scheme1_hash(cfg) != cfg.run_hash()
    ident = stored_identity(data)
    assert (ident.run_hash, ident.legacy) == (cfg.run_hash(), False)
    assert rd.config_hash() == cfg.run_hash() and runs_by_hash(tmp_path) == {cfg.run_hash(): [rd.path]}
    check_folder(rd, cfg, force=False)  # the same config: it may resume there
    with pytest.raises(RunExistsError, match="another config"):
        check_folder(rd, cfg.replace(seed=1), force=False)
    data["meta"]["run_hash"] = "0123abcd"  # recorded by code whose config differed: made by older code
    assert stored_identity(data).legacy


def test_committed_runs_keep_counting():
    """Every committed run folder's identity is recomputed from its stored config, none is legacy, none is shared."""
    index = runs_by_hash(RUNS_ROOT)
    folders = [p for ps in index.values() for p in ps]
    assert len(folders) >= 291 and len(index) == len(folders)
    for p in folders[:: max(1, len(folders) // 25)]:
        data = RunDir(p).read_config()
        ident = stored_identity(data)
        assert ident.recomputed is not None and not ident.legacy
        assert p.name.endswith(data["meta"]["run_hash"])


def test_an_old_run_id_still_resolves_to_its_run():
    """`experiments.run --sweep S --run ID` with the id a committed folder was made with finds that config."""
    from experiments.sweep import resolve_run

    folder = sorted((RUNS_ROOT / "delta").iterdir())[0]
    spec = resolve_run("delta", folder.name)
    assert spec.config.run_hash() == RunDir(folder).config_hash()
    assert spec.run_id != folder.name  # today's id (the folder keeps its own)


def test_every_committed_run_folder_is_done():
    """Only finished runs are committed (a run in progress is resumed into its folder, and the analysis excludes it):
    every status.json that git tracks under results/runs reads done, and every tracked run folder has one."""
    import subprocess

    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing here says which folders are committed")
    tracked = subprocess.run(
        ["git", "ls-files", "--", "results/runs"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    folders = {str(Path(f).parent) for f in tracked if Path(f).name == "config.yaml"}
    assert len(folders) >= 291
    statuses = {str(Path(f).parent) for f in tracked if Path(f).name == "status.json"}
    assert folders <= statuses, sorted(folders - statuses)[:5]
    not_done = [f for f in sorted(folders) if RunDir(REPO_ROOT / f).state() != "done"]
    assert not not_done, f"committed run folders that are not done: {not_done[:5]}"


def test_every_committed_run_is_planned_by_its_sweep_file_today():
    """A preset or sweep edit never moves a committed run: each sweep file, expanded today with the preset its runs
    were made with, still plans every committed run of it (the same identity hash), so `slurm.submit` skips them."""
    from experiments.sweep import SWEEPS_DIR, expand

    checked = 0
    for sweep_dir in sorted(p for p in RUNS_ROOT.iterdir() if p.is_dir()):
        path = SWEEPS_DIR / f"{sweep_dir.name}.yaml"
        folders = [p for p in sorted(sweep_dir.iterdir()) if (p / "config.yaml").is_file()]
        if not path.is_file() or not folders:
            continue
        metas = [RunDir(p).read_config()["meta"] for p in folders]
        presets = sorted({m.get("preset") or "tiny" for m in metas})
        planned = {spec.config.run_hash() for pr in presets for spec in expand(path, preset=pr)}
        for p in folders:
            assert RunDir(p).config_hash() in planned, f"{p.relative_to(RUNS_ROOT)} is not planned by {path.name}"
            checked += 1
    assert checked >= 291
