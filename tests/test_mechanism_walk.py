"""experiments.mechanism --sweep: the gate walks a sweep's hard baseline on the single-run trainer and writes its run
folder, which equals the one `python -m experiments.run --sweep ... --run ...` writes (every logged field but
wall-clock time); the gate file has a header (git commit, command); a walk stopped mid-run resumes from the run's
checkpoint and ends with the same folder and states; a finished walk is skipped, never rerun. Tiny setting (4 prompts
x 8 samples, a 120-step warm start, 8 RL steps): about a minute on one core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from analysis import mechanism as A
from experiments.mechanism import toy as M
from experiments.rundir import REPO_ROOT, RunDir, read_rows

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

SWEEP = """\
name: walk
preset: tiny-smoke
base: {sft.steps: 120, sft.warmup: 20, rollout.prompts_per_step: 4, train.steps: 8, eval.n_prompts: 64,
  eval.every: 4, logging.checkpoint_every: 4, logging.progress: false}
arms:
  hard: {loss.rule: hard}
seeds: [7]
tie: {sft.seed: seed}
baseline: hard
"""
WALL = ("wall_s",)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("nsr-cache")
    values = {"NSR_CACHE_DIR": str(cache), "NSR_THREADS": "1", "NSR_WARM_STARTS": ""}
    for k, v in values.items():
        mp.setenv(k, v)
    yield values
    mp.undo()


def _args(sweep, root, out, *extra):
    return [
        "--sweep", str(sweep), "--seeds", "7", "--rules", "soft,nsr", "--states", "2", "--start", "4", "--every", "4",
        "--no-held-out", "--score-dtype", "float32", "--runs-root", str(root), "--out", str(out), "--quiet", *extra,
    ]  # fmt: skip


def _folder(root):
    (path,) = (root / "walk").iterdir()
    return RunDir(path)


def _logs(rd: RunDir) -> dict:
    """Every log of a run folder, wall-clock fields dropped, and its config.yaml and final state."""
    out = {}
    for name in ("metrics.jsonl", "ratio_bins.jsonl", "eval.jsonl"):
        rows, problems = read_rows(rd.log_path(name))
        assert rows and not problems
        out[name] = [{k: v for k, v in r.items() if k not in WALL} for r in rows]
    out["config"] = yaml.safe_load(rd.config_path.read_text())
    out["state"] = rd.state()
    out["files"] = sorted(p.name for p in rd.path.iterdir() if not p.name.startswith("."))
    return out


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """The run as experiments.run writes it (its CLI, a subprocess), and the sweep file."""
    tmp = tmp_path_factory.mktemp("walk-ref")
    sweep = tmp / "walk.yaml"
    sweep.write_text(SWEEP)
    (spec,) = M.baseline_specs(sweep, [7])
    ref = tmp / "ref"
    cmd = [sys.executable, "-m", "experiments.run", "--sweep", str(sweep), "--run", spec.run_id, "--out", str(ref)]
    res = subprocess.run(cmd, cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    return sweep, spec, RunDir(ref)


def test_walked_folder_equals_experiments_run_and_the_file_has_a_header(reference, tmp_path, capsys):
    sweep, spec, ref = reference
    root, out = tmp_path / "runs", tmp_path / "gate-s{seed}.jsonl"
    assert M.main(_args(sweep, root, out)) == 0
    walked = _folder(root)
    assert walked.path.name == spec.run_id
    assert _logs(walked) == _logs(ref)  # metrics, ratio bins, evals, config.yaml (identity, meta), state done
    assert _logs(walked)["state"] == "done" and _logs(walked)["config"]["meta"]["arm"] == "hard"

    gate_file = tmp_path / "gate-s7.jsonl"
    (head,) = A.load_headers(gate_file)
    assert head["git_commit"] == _logs(ref)["config"]["meta"]["git_commit"]
    assert head["command"].startswith("python -m experiments.mechanism --sweep") and "--seeds 7" in head["command"]
    assert head["run_id"] == spec.run_id and head["resumed_from_step"] == 0
    states = A.load_states(gate_file)
    assert [(s["seed"], s["sft_seed"], s["step"]) for s in states] == [(7, 7, 4), (7, 7, 8)]
    assert set(states[0]["train_after"]) == {"hard", "soft", "nsr"}
    g = A.gate(states, "soft")
    assert g["runs"] == 1 and g["states"] == 2
    capsys.readouterr()

    # a finished walk is skipped: folder and file stay as they were
    before = gate_file.read_bytes(), walked.metrics_path.read_bytes()
    assert M.main(_args(sweep, root, out)) == 0
    assert "skipped" in capsys.readouterr().err
    assert (gate_file.read_bytes(), walked.metrics_path.read_bytes()) == before

    # a done folder whose file lacks states is refused, before any work
    gate_file.write_text(gate_file.read_text().splitlines()[0] + "\n")
    assert M.main(_args(sweep, root, out)) == 2
    assert "lacks the states of steps [4, 8]" in capsys.readouterr().err


def test_a_stopped_walk_resumes_from_the_checkpoint(reference, tmp_path, monkeypatch):
    """Stopped while testing the state of step 8 (after the step-4 checkpoint): the rerun resumes the run from
    step 4, keeps the file's state of step 4, and ends with the uninterrupted run's folder and states."""
    sweep, spec, ref = reference
    root, out = tmp_path / "runs", tmp_path / "gate-s{seed}.jsonl"
    real = M.walk_state

    def stop_at_8(model, opt, run_cfg, specs, task, step, *a):
        if step == 8:
            raise KeyboardInterrupt("stopped")
        return real(model, opt, run_cfg, specs, task, step, *a)

    monkeypatch.setattr(M, "walk_state", stop_at_8)
    with pytest.raises(KeyboardInterrupt):
        M.walk_sweep(sweep, [7], "soft,nsr", 2, 4, 4, str(out), runs_root=root, held_out=False, command="x")
    walked = _folder(root)
    assert walked.state() == "cancelled" and walked.checkpoint_path.exists()
    first = A.load_states(tmp_path / "gate-s7.jsonl")
    assert [s["step"] for s in first] == [4]

    monkeypatch.setattr(M, "walk_state", real)
    res = M.walk_sweep(sweep, [7], "soft,nsr", 2, 4, 4, str(out), runs_root=root, held_out=False, command="y")
    assert [r.step for r in res] == [4, 8]
    assert _logs(walked) == _logs(ref)
    heads = A.load_headers(tmp_path / "gate-s7.jsonl")
    assert [(h["command"], h["resumed_from_step"]) for h in heads] == [("x", 0), ("y", 4)]
    states = A.load_states(tmp_path / "gate-s7.jsonl")
    assert [s["step"] for s in states] == [4, 8] and states[0] == first[0]
