"""Hostile input to runs, sweeps and the submitter (outside the analysis): every case is refused before any work
with the file, key and allowed values named, or reported as a bad folder; never a traceback, a silent wrong run, or
advice that loses data. Each test reproduces a case that went through, crashed or lost data before (the numbers are
the items of the "fail loudly" issue). No training runs here: folders are written with the run-folder API, and the
CLI stops before the backend, so the file takes a few seconds."""

import errno
import fcntl
import json
import os
import re
import subprocess
import textwrap
import time

import pytest

import experiments.run as run_cli
from experiments.config import ConfigError, RunConfig, load_config
from experiments.rundir import (
    REPO_ROOT,
    RunDir,
    RunExistsError,
    RunLockedError,
    folders_of,
    read_status,
    runs_by_hash,
)
from experiments.sweep import SweepError, expand
from experiments.yamlio import load_yaml
from slurm.status import rows as status_rows
from slurm.submit import load_site, plan
from slurm.submit import main as submit_main

SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"


def write(path, text: str | bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text))
    return path


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".lock"}


def done_folder(folder, cfg: RunConfig, **meta):
    """A finished run's folder as experiments.run leaves it (config.yaml with meta.run_hash, status done)."""
    rd = RunDir(folder)
    rd.write_config(cfg, **meta)
    rd.append("metrics.jsonl", [{"step": 1, "reward_mean": 0.5}])
    rd.set_status("done", run_hash=cfg.run_hash())
    return rd


# ---------------------------------------------------------------- 3. duplicate keys
def test_duplicate_key_in_a_config_file_is_refused_with_its_line(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", "backend: tiny\nloss:\n  rule: hard\n  delta: 0.2\nloss:\n  rule: nsr\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: line 5: duplicate key 'loss' \(first at line 2\)"):
        load_config(cfg)
    nested = write(tmp_path / "n.yaml", "train: {steps: 3, lr: 1.0e-4, steps: 5}\n")
    with pytest.raises(ConfigError, match=r"n\.yaml: line 1: duplicate key 'steps'"):
        load_config(nested)
    assert run_cli.main([str(cfg), "--out", str(tmp_path / "run")]) == 2
    assert "duplicate key 'loss'" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_duplicate_arm_in_a_sweep_is_refused(tmp_path):
    """`hard:` twice used to run loss.rule=nsr under the id hard-s0-..."""
    sw = write(
        tmp_path / "dup.yaml",
        """\
        preset: tiny-smoke
        arms:
          hard: {loss.rule: hard}
          hard: {loss.rule: nsr}
        """,
    )
    with pytest.raises(SweepError, match=r"dup\.yaml: line 4: duplicate key 'hard' \(first at line 3\)"):
        expand(sw)


def test_duplicate_key_in_the_site_file_and_yaml_anchors_still_work(tmp_path):
    site = write(tmp_path / "site.yaml", "presets:\n  tiny: {time_min: 10}\n  tiny: {time_min: 20}\n")
    with pytest.raises(ConfigError, match=r"site\.yaml: line 3: duplicate key 'tiny'"):
        load_site(site)
    merged = write(tmp_path / "m.yaml", "a: &x {k: 1, j: 2}\nb:\n  <<: *x\n  k: 3\n")
    assert load_yaml(merged) == {"a": {"k": 1, "j": 2}, "b": {"k": 3, "j": 2}}  # overriding a merged key is fine


# ---------------------------------------------------------------- 4. empty config
@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_empty_config_file_is_refused_and_says_how_to_get_the_defaults(tmp_path, capsys, text):
    cfg = write(tmp_path / "empty.yaml", text)
    assert run_cli.main([str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: empty config file" in err and "sweeps/presets/tiny.yaml" in err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 5. numbers: finite, in range, sizes that fit
BAD_NUMBERS = [
    ("train.lr=.inf", r"train\.lr=inf is not valid; allowed: a finite number"),
    ("train.lr=1e999", r"train\.lr='1e999' is not valid; allowed: a finite number"),
    ("train.entropy_coef=.nan", r"train\.entropy_coef=nan is not valid; allowed: a finite number"),
    ("train.weight_decay=-5", r"train\.weight_decay=-5\.0 is not valid; allowed: a finite number >= 0 and <= 1"),
    ("loss.eps_high=.inf", r"loss\.eps_high=inf is not valid; allowed: a finite number"),
    ("sft.seed=-3", r"sft\.seed=-3 is not valid; allowed: a finite number >= 0"),
    ("sft.weight_decay=-1", r"sft\.weight_decay=-1\.0 is not valid; allowed: a finite number >= 0"),
    ("rollout.temperature=.inf", r"rollout\.temperature=inf is not valid"),
    ("eval.n_samples=1000000000", r"eval\.n_samples=1000000000 is not valid; allowed: a finite number >= 0 and <="),
    ("model.d_model=4000000", r"model\.d_model=4000000 is not valid; allowed: a finite number >= 1 and <= 8192"),
    ("model.d_model=4096", r"model\.d_model=4096 is not valid; allowed: 12 x n_layer x d_model\^2 <= 1e\+08"),
    ("eval.n_samples=4096", r"eval\.n_samples=4096 is not valid; allowed: eval\.n_prompts x n_samples <= 131072"),
    ("logging.checkpoint_every=-1", r"logging\.checkpoint_every=-1 is not valid"),
    ("seed=-1", r"seed=-1 is not valid; allowed: a finite number >= 0"),
    ("eval.seed=99999999999", r"eval\.seed=99999999999 is not valid"),
    ("train.steps=100000000", r"train\.steps=100000000 is not valid; allowed: a finite number >= 1 and <= 1000000"),
    ("openrlhf.lr_warmup_ratio=2", r"openrlhf\.lr_warmup_ratio=2\.0 is not valid; allowed: a finite number >= 0"),
    # 0 is valid: derived from train.minibatches
    ("openrlhf.train_batch_size=-1", r"openrlhf\.train_batch_size=-1 is not valid"),
]


@pytest.mark.parametrize("override, message", BAD_NUMBERS, ids=[o for o, _ in BAD_NUMBERS])
def test_non_finite_or_out_of_range_numbers_are_refused_before_any_folder(tmp_path, capsys, override, message):
    out = tmp_path / "run"
    assert run_cli.main([str(SMOKE), override, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert str(SMOKE) in err and not out.exists()


def test_a_sweep_with_one_non_finite_value_submits_nothing(tmp_path, capsys):
    sw = write(
        tmp_path / "lr.yaml", "preset: tiny-smoke\narms: {hard: {loss.rule: hard}}\ngrid: {train.lr: [1.0e-3, .inf]}\n"
    )
    with pytest.raises(SweepError, match=r"lr\.yaml: run hard-lr.* train\.lr=.*inf.* allowed: a finite number"):
        expand(sw)
    argv = [str(sw), "--out-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs"), "--cluster", "local"]
    assert submit_main(argv) == 2 and "a finite number" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------- 7. unreadable status.json
BAD_STATUS = [b"[1]", b"\x89PNG\r\n\x1a\n\x00\x00", b'"done"', b'{"state": 7}', b"{not json"]


@pytest.mark.parametrize("content", BAD_STATUS, ids=["list", "binary", "string", "bad-state", "not-json"])
def test_bad_status_json_is_a_bad_folder_not_a_crash(tmp_path, capsys, content):
    cfg = load_config(SMOKE)
    rd = RunDir(tmp_path / "run")
    rd.write_config(cfg)
    write(rd.status_path, content)
    st = read_status(rd.status_path)
    assert st["state"] == "bad" and str(rd.status_path) in st["problem"]
    assert rd.state() == "bad"

    before = snapshot(rd.path)
    assert run_cli.main([str(SMOKE), "--out", str(rd.path), "--no-progress"]) == 3  # same config, unreadable state
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(rd.status_path) in err and "Traceback" not in err
    assert snapshot(rd.path) == before  # nothing touched


def test_one_bad_folder_does_not_block_the_sweep(tmp_path, capsys):
    specs = expand("rescue_vs_decay", preset="tiny-smoke")
    root = tmp_path / "runs"
    bad = RunDir(root / specs[0].sweep / specs[0].run_id)
    bad.write_config(specs[0].config)
    write(bad.status_path, b"[1]")
    garbled = RunDir(root / specs[1].sweep / specs[1].run_id)
    write(garbled.config_path, b"\xff\xfe binary")
    decisions = plan(specs, root, False, {})
    assert [d.submit for d in decisions] == [False, False] + [True] * (len(specs) - 2)
    assert decisions[0].reason.startswith("bad folder, not touched: ") and "not a JSON object" in decisions[0].reason
    assert "not a text file" in decisions[1].reason

    argv = ["rescue_vs_decay", "--preset", "tiny-smoke", "--dry-run", "--out-root", str(root)]
    assert submit_main(argv) == 0
    assert capsys.readouterr().out.count("bad folder, not touched") == 2
    table = status_rows("rescue_vs_decay", preset="tiny-smoke", out_root=root)
    assert [r["state"] for r in table[:3]] == ["bad", "bad", "-"]
    assert "not a JSON object" in table[0]["error"] and "not a text file" in table[1]["error"]


# ---------------------------------------------------------------- 8. binary config, --out at a file / read-only
def test_binary_config_file_is_a_clear_error(tmp_path, capsys):
    cfg = write(tmp_path / "model.yaml", bytes(range(256)))
    assert run_cli.main([str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"model\.yaml: not a text file \(byte \d+ is not UTF-8\); allowed: a YAML file", err), err
    assert not (tmp_path / "run").exists()


def test_out_at_a_file_is_a_clear_error(tmp_path, capsys):
    target = write(tmp_path / "notes.txt", "keep me\n")
    assert run_cli.main([str(SMOKE), "--out", str(target), "--no-progress"]) == 3
    assert f"{target}: is a file" in capsys.readouterr().err and target.read_text() == "keep me\n"
    assert run_cli.main([str(SMOKE), "--out", str(target / "run"), "--no-progress"]) == 3  # a file in the path
    assert "cannot write the run folder here" in capsys.readouterr().err


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only place: a read-only tmpfs as root (root ignores permission bits), else a 0o555 folder."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {p.stderr.decode().strip()}")
        yield path
        subprocess.run(["umount", str(path)], check=True)
    else:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)


def test_out_on_a_read_only_place_is_a_clear_error(read_only_dir, capsys):
    assert run_cli.main([str(SMOKE), "--out", str(read_only_dir / "run"), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert re.search(r"ro/run: cannot write the run folder here \((Read-only file system|Permission denied)\)", err)


def test_submit_to_a_read_only_root_submits_nothing(read_only_dir, tmp_path, capsys):
    argv = ["delta", "--preset", "tiny-smoke", "--cluster", "local", "--log-dir", str(tmp_path / "logs")]
    assert submit_main([*argv, "--out-root", str(read_only_dir / "runs")]) == 2
    err = capsys.readouterr().err
    assert "ro/runs/delta: cannot write here" in err and "nothing was submitted" in err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


# ---------------------------------------------------------------- 10. another config's done run
def test_done_folder_of_another_config_is_refused_even_with_force(tmp_path, capsys):
    """The old message said 'this run is done; pass --force', and --force then wiped the other config's run."""
    other = done_folder(tmp_path / "run", load_config(SMOKE, ["seed=7"]))
    before = snapshot(other.path)
    for extra in ([], ["--force"]):
        assert run_cli.main([str(SMOKE), "--out", str(other.path), "--no-progress", *extra]) == 3
        err = capsys.readouterr().err
        assert "holds a run of another config" in err and "pass --force" not in err
        assert snapshot(other.path) == before


def test_checks_run_under_the_folder_lock(tmp_path):
    """The folder is locked before it is checked: a process holding it is reported, whatever the folder says."""
    cfg = load_config(SMOKE)
    rd = done_folder(tmp_path / "run", load_config(SMOKE, ["seed=7"]))
    with rd.lock():  # another process would hold it the same way
        with pytest.raises(RunLockedError):
            run_cli.run(cfg, rd.path, progress=False)
    with pytest.raises(RunExistsError, match="another config"):
        run_cli.run(cfg, rd.path, progress=False)


def test_a_folder_that_is_not_a_run_folder_is_refused(tmp_path, capsys):
    home = write(tmp_path / "home" / "thesis.tex", "\\documentclass{article}\n").parent
    assert run_cli.main([str(SMOKE), "--out", str(home), "--no-progress", "--force"]) == 3
    assert "is not a run folder (holds thesis.tex" in capsys.readouterr().err
    assert sorted(p.name for p in home.iterdir()) == ["thesis.tex"]


# ---------------------------------------------------------------- 11. CLI: --preset alone, overrides after options
def test_preset_without_sweep_is_refused(tmp_path, capsys):
    assert run_cli.main([str(SMOKE), "--preset", "tiny", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--preset tiny needs --sweep" in err and "sweeps/presets/tiny.yaml" in err
    assert not (tmp_path / "run").exists()


def test_overrides_after_options_are_accepted(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli.main([str(SMOKE), "--out", str(out), "seed=3", "loss.rule=nsr", "--dry-run"]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["argv"][3:] == [str(SMOKE), "seed=3", "loss.rule=nsr", "--out", str(out)]
    assert line["run_id"].endswith(load_config(SMOKE, ["seed=3", "loss.rule=nsr"]).run_hash())


# ---------------------------------------------------------------- a config runs once (issue 11 item 1)
def test_runs_by_hash_finds_copies_and_reports_unreadable_configs(tmp_path):
    cfg = load_config(SMOKE)
    a = done_folder(tmp_path / "delta" / "hard-s0", cfg)
    copy = tmp_path / "backup" / "old" / "hard-s0"
    copy.mkdir(parents=True)
    for p in a.path.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    write(tmp_path / "x" / "broken" / "config.yaml", "meta: {run_hash: a\n")
    bad = []
    index = runs_by_hash(tmp_path, bad)
    assert index == {cfg.run_hash(): sorted([a.path, copy])}
    assert [p.name for p, _ in bad] == ["broken"] and "not valid YAML" in bad[0][1]
    # folders_of: the done folder first even when another sorts before it; the asking folder left out
    status = json.loads((copy / "status.json").read_text())
    (copy / "status.json").write_text(json.dumps({**status, "state": "failed"}))
    assert folders_of(index, cfg.run_hash()) == [a.path, copy]
    assert folders_of(index, cfg.run_hash(), exclude=a.path) == [copy] and folders_of(index, "f" * 8) == []


def test_submitter_skips_a_config_done_or_queued_in_another_sweep(tmp_path):
    delta = {s.config.run_hash(): s for s in expand("delta", preset="tiny-smoke")}
    rvd = expand("rescue_vs_decay", preset="tiny-smoke")
    shared = [s for s in rvd if s.config.run_hash() in delta]
    assert len(shared) == 3  # hard, nsr at delta 0.2, widened by 0.2
    root = tmp_path / "runs"
    hard, nsr, widened = shared
    done_folder(root / "delta" / delta[hard.config.run_hash()].run_id, hard.config)
    queued = root / "delta" / delta[nsr.config.run_hash()].run_id  # as slurm.submit leaves a folder it queued
    RunDir(queued).write_config(nsr.config)
    (queued / "slurm.json").write_text(json.dumps({"job_id": "41_3", "cluster": "slurm"}))

    got = {d.spec.run_id: d for d in plan(rvd, root, False, {"41_3": "PENDING"})}
    assert not got[hard.run_id].submit and got[hard.run_id].reason.startswith("done in ")
    assert str(root / "delta" / delta[hard.config.run_hash()].run_id) in got[hard.run_id].reason
    assert not got[nsr.run_id].submit and got[nsr.run_id].reason == f"job 41_3 is PENDING in {queued} (the same config)"
    assert got[widened.run_id].submit  # nowhere else yet
    assert sum(d.submit for d in got.values()) == len(rvd) - 2
    again = {d.spec.run_id: d.submit for d in plan(rvd, root, False, {})}  # the queued job left: run it here
    assert again[nsr.run_id] and not again[hard.run_id]


def test_rerun_by_id_finds_the_config_done_under_another_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_cli, "RUNS_ROOT", tmp_path / "runs")  # the runs root of this test, not the repo's
    spec = next(s for s in expand("delta", preset="tiny-smoke") if s.run_id.startswith("hard-"))
    where = done_folder(tmp_path / "runs" / "rescue_vs_decay" / spec.run_id, spec.config).path
    argv = ["--sweep", "delta", "--run", spec.run_id, "--preset", "tiny-smoke", "--no-progress"]
    assert run_cli.main(argv) == 3
    err = capsys.readouterr().err
    assert f"is done in {where}" in err and "a config runs once" in err
    assert not (tmp_path / "runs" / "delta").exists()


# ---------------------------------------------------------------- locks where flock is missing (Lustre)
def test_lock_falls_back_to_a_soft_lock_where_flock_is_missing(tmp_path, capsys, monkeypatch):
    """No Lustre here: flock is made to fail as Lustre without -o flock fails it (ENOSYS); the rest is real."""

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    rd = RunDir(tmp_path / "run")
    with rd.lock():
        assert "does not support flock" in capsys.readouterr().err and rd.soft_lock_path.exists()
        assert rd.locked()
        with pytest.raises(RunLockedError, match="soft lock"):
            with RunDir(rd.path).lock(wait=0.2):
                pass
        capsys.readouterr()
        assert rd.locked() and capsys.readouterr().err == ""  # a probe reads the soft lock: no note
    assert not rd.soft_lock_path.exists() and not rd.locked()
    assert not rd.soft_lock_path.exists() and capsys.readouterr().err == ""  # the probe took no lock


def test_a_soft_lock_waits_like_flock_and_a_probe_never_takes_it(tmp_path, monkeypatch):
    """A run starting while slurm.status probes the folder is not refused where flock is missing (the probe reads
    the soft lock file and never creates it), and lock(wait) waits for a holder that lets go."""
    import threading

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOSYS, "no flock")))
    rd = RunDir(tmp_path / "run")
    with rd.lock():
        pass
    taken = threading.Event()

    def hold():
        with RunDir(rd.path).lock():
            taken.set()
            time.sleep(0.5)

    t = threading.Thread(target=hold)
    t.start()
    taken.wait(5)
    assert rd.locked()
    with RunDir(rd.path).lock(wait=10):  # the holder lets go after 0.5 s: this waits for it
        assert rd.locked()
    t.join()
    assert not rd.locked()
