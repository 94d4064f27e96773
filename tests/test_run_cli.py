"""``python -m experiments.run`` on the tiny backend: bad input, a finished run, --force, SIGTERM, another config."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_tiny import SMOKE

from experiments.run import main
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl

SHORT = ["train.steps=3", "eval.every=0", "eval.n_prompts=8", "eval.n_samples=2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.rule=bogus"], r"loss\.rule='bogus' is not valid; allowed: hard, nsr"),
        (["task.name=bogus"], r"task\.name='bogus' is not valid; allowed: countdown3, add3"),
        (["model.name=gpt-7"], r"model\.name='gpt-7' is not valid; allowed: tiny-gpt2"),
        (["rollout.max_new_tokens=4"], r"rollout\.max_new_tokens=4 is not valid; allowed: >= 6"),
        (["eval.n_prompts=1000"], r"eval\.n_prompts=1000 is not valid; allowed: <= 512"),
        (["train.minibatches=3"], r"train\.minibatches=3 is not valid; allowed: a divisor of .* = 128"),
        (["loss.delta=1.5"], r"loss\.delta=1\.5 is not valid; allowed: .*0 <= delta < 1"),
        (["train.lrr=1"], r"unknown key 'train\.lrr'"),
        (["seed=x"], r"seed='x' is not valid; allowed: an integer"),
    ],
)
def test_bad_config_fails_clearly_and_creates_no_folder(tmp_path, capsys, overrides, message):
    out = tmp_path / "run"
    assert main([str(SMOKE), *overrides, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(SMOKE) in err
    assert re.search(message, err), err
    assert not out.exists()


def test_missing_config_file(tmp_path, capsys):
    assert main([str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "run")]) == 2
    assert "no such config file" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["0", "two"])
def test_bad_nsr_threads_fails_the_run_folder_naming_the_variable(tmp_path, capsys, monkeypatch, value):
    # the environment is no config key, so the folder is made; it must say why the run never started (under SLURM
    # the job's log is elsewhere), and a rerun with a good value resumes it
    monkeypatch.setenv("NSR_THREADS", value)
    out = tmp_path / "run"
    assert main([str(SMOKE), *SHORT, "--out", str(out), "--no-progress"]) == 2
    message = f"NSR_THREADS={value!r} is not valid; allowed: a positive integer"
    assert message in capsys.readouterr().err
    st = RunDir(out).status()
    assert st["state"] == "failed" and message in st["error"] and "threads" not in st
    assert not RunDir(out).metrics_path.exists()
    # a folder with a status is left as it was: --force must not clear a done run for a run that cannot start
    from experiments.config import load_config

    done = RunDir(tmp_path / "done")
    done.write_config(load_config(SMOKE, SHORT))
    done.set_status("done")
    done.metrics_path.write_text('{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in done.path.iterdir() if p.is_file() and p.name != ".lock"}
    assert main([str(SMOKE), *SHORT, "--out", str(done.path), "--force", "--no-progress"]) == 2
    assert {p.name: p.read_bytes() for p in done.path.iterdir() if p.is_file() and p.name != ".lock"} == before


@pytest.mark.slow
def test_done_run_is_not_overwritten_without_force(run_env, tmp_path, capsys):
    out = tmp_path / "run"
    args = [str(SMOKE), *SHORT, "--out", str(out), "--no-progress"]
    assert main(args) == 0
    rd = RunDir(out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert rd.state() == "done"

    assert main(args) == 3
    assert "this run is done; pass --force" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before

    assert main([*args, "--force"]) == 0
    assert rd.state() == "done" and rd.status()["attempts"] == 1  # cleared, then run from scratch
    assert rd.status()["threads"] == int(os.environ.get("NSR_THREADS", "1"))  # what a bit-identical rerun needs
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    old_rows = [json.loads(line) for line in before["metrics.jsonl"].splitlines()]
    assert strip(read_jsonl(rd.metrics_path)) == strip(old_rows)


@pytest.mark.slow
def test_sigterm_records_cancelled_and_the_run_resumes(run_env, tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.run", str(SMOKE), "logging.checkpoint_every=4", "eval.every=0"]
    proc = subprocess.Popen([*cmd, "--out", str(out), "--no-progress"], cwd=REPO_ROOT, stderr=subprocess.PIPE)
    rd = RunDir(out)
    deadline = time.time() + 240
    while not (rd.metrics_path.exists() and len(read_jsonl(rd.metrics_path)) >= 6):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    proc.stderr.close()
    st = rd.status()
    assert st["state"] == "cancelled" and "Cancelled" in st["error"]
    assert rd.checkpoint_path.exists()

    # an unfinished folder of another config is refused and left alone
    assert main([str(SMOKE), "seed=5", "--out", str(out), "--no-progress"]) == 3
    assert "holds a run of another config" in capsys.readouterr().err
    assert rd.state() == "cancelled" and rd.checkpoint_path.exists()

    assert main([str(SMOKE), "logging.checkpoint_every=4", "eval.every=0", "--out", str(out), "--no-progress"]) == 0
    assert rd.state() == "done" and rd.status()["attempts"] == 2
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == list(range(1, 31))


def test_dry_run_of_a_tiny_sweep_prints_the_command_that_reruns_each_run(capsys):
    """--dry-run on the tiny backend: one JSON line per run whose argv reruns exactly that grid point; no folder."""
    from experiments.sweep import expand

    specs = expand("rescue_vs_decay", preset="tiny-smoke")
    folders = [REPO_ROOT / "results" / "runs" / s.sweep / s.run_id for s in specs]
    before = [f.exists() for f in folders]
    assert main(["--sweep", "rescue_vs_decay", "--preset", "tiny-smoke", "--dry-run"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["run_id"] for x in lines] == [s.run_id for s in specs]
    for x in lines:
        assert x["openrlhf_argv"] is None and x["argv"][1:3] == ["-m", "experiments.run"]
        assert x["argv"][x["argv"].index("--run") + 1] == x["run_id"]
    assert [f.exists() for f in folders] == before  # a dry run creates no run folder


def test_a_resume_at_another_thread_count_is_noted(tmp_path, capsys):
    from experiments.run import _note_thread_change

    rd = RunDir(tmp_path / "run")
    rd.set_status("running", threads=2)
    rd.set_status("cancelled")
    _note_thread_change(rd, 2)
    assert capsys.readouterr().err == ""  # the same count: a bit-identical resume
    _note_thread_change(rd, 1)
    err = capsys.readouterr().err
    assert "NSR_THREADS=1, its earlier attempts used 2" in err and "NSR_THREADS=2 keeps it a bit-identical" in err
