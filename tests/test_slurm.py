"""End to end on a real single-node SLURM (slurm/local_cluster.sh): tiny-smoke sweeps submitted with submitit,
resubmission, a failing run, scancel, scontrol requeue and preemption (USR2), --cluster local/debug, and the
Ray bootstrap. Skipped with a reason when no cluster can be started (not root); a failure under CI=true."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from contextlib import suppress
from pathlib import Path

import pytest
import submitit
import yaml
from conftest import skip_or_fail

from experiments.rundir import RunDir, read_jsonl
from experiments.sweep import expand
from experiments.trl.train import checkpoint_rl_step, latest_checkpoint
from slurm import queue, stop
from slurm.status import main as status_main
from slurm.status import progress, rows
from slurm.submit import main, plan, submit

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "slurm" / "local_cluster.sh"


def _cluster_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, check=False)
    return p.returncode == 0 and any(s in p.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if not _cluster_up() and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", str(SCRIPT), "start"], check=False, timeout=900)
    if not _cluster_up():
        skip_or_fail("no single-node SLURM here: run `bash slurm/local_cluster.sh start` as root (make test does)")


def sweep_file(tmp_path, name, body) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\npreset: tiny-smoke\n" + textwrap.dedent(body))
    return p


def wait_for(cond, timeout, what, story=None):
    """``cond()`` once it is true; a timeout names ``what``, and ``story()`` (what the run and its job say) if given."""
    end = time.time() + timeout
    while time.time() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{story()}" if story else ""))


def job_story(folder: Path, job: str, log_dir: Path) -> str:
    """A run folder's status, its job in squeue and sacct (every attempt), the nodes that start no job (a full disk
    drains the node and holds the job it failed to launch), and the ends of the job's logs: what a timed-out wait
    reports, so that a failure in CI says where the job stood."""

    def out(*cmd: str) -> str:
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        return (p.stdout + p.stderr).strip()

    def nodes() -> str:
        try:
            return "; ".join(queue.node_problems()) or "none"
        except queue.QueueError as e:
            return str(e)

    lines = [
        f"status.json: {RunDir(folder).status()}",
        f"squeue: {out('squeue', '-h', '-j', job, '-o', '%T %r begin=%S') or '(not in the queue)'}",
        "sacct:\n" + out("sacct", "-n", "-X", "-D", "-j", job, "-o", "JobID,State,ExitCode,Start,End"),
        f"nodes that start no job: {nodes()}",
    ]
    for log in sorted((log_dir / job).glob("*_log.*")):
        text = "\n".join(line for line in log.read_text(errors="replace").splitlines() if "it/s]" not in line)
        lines.append(f"--- {log.name} (end):\n{text[-1500:]}")
    return "\n".join(lines)


def metrics(folder: Path) -> list[dict]:
    rows_ = read_jsonl(folder / "metrics.jsonl")
    for r in rows_:
        r.pop("wall_s")
    return rows_


def n_rows(folder: Path) -> int:
    with suppress(FileNotFoundError):
        return sum(1 for line in open(folder / "metrics.jsonl") if line.strip())
    return 0


def squeue_state(job: str) -> str:
    p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, check=False)
    return p.stdout.strip()


def all_ended(table: list[dict]) -> list[dict] | None:
    return table if all(r["sacct"] not in queue.LIVE_STATES for r in table) else None


def finish(jobs):
    for j in jobs:
        with suppress(Exception):
            j.result()


SMOLLM2_SMALL = (
    "train.steps: 2, rollout.prompts_per_step: 4, rollout.samples_per_prompt: 4, eval.n_prompts: 4, eval.n_samples: 2"
)
"""Overrides of the 2-step SmolLM2 run on the local SLURM (the TRL preset's own batch otherwise)."""


def _alloc_tres(job: str) -> str:
    p = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "AllocTRES%200"], capture_output=True, text=True)
    return p.stdout.strip()


def test_local_cluster_script_is_idempotent():
    t0 = time.time()
    start = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, check=False, timeout=120)
    assert start.returncode == 0, start.stderr
    assert time.time() - t0 < 30  # already up: nothing to install or restart
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True, check=False)
    assert status.returncode == 0, status.stdout
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"):
        assert f"{daemon}: running" in status.stdout
    assert subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, check=False).returncode == 0


@pytest.mark.timeout(600)
def test_sweep_finishes_resubmits_nothing_and_reports_a_failure(tmp_path, capsys):
    good = sweep_file(
        tmp_path,
        "smoke",
        """
        base: {train.steps: 4, eval.every: 2}
        arms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}, soft: {loss.rule: soft}, pushout: {loss.rule: pushout}}
        baseline: hard
        """,
    )
    # The failing run: a site whose job setup breaks the environment (NSR_THREADS=0), so the real tiny backend
    # raises inside the job after it started; it is submitted first and runs next to the good ones.
    bad = sweep_file(tmp_path, "broken", "base: {train.steps: 4}\narms: {nsr: {loss.rule: nsr}}\n")
    site = tmp_path / "site.yaml"
    site.write_text("presets:\n  tiny-smoke: {time_min: 10, setup: ['export NSR_THREADS=0']}\n")
    kw = {"cluster": "slurm", "out_root": tmp_path / "runs", "log_dir": tmp_path / "logs", "batch_size": 1}

    sub_bad = submit(bad, site=site, **kw)
    sub = submit(good, **kw)
    assert len(sub.submitted) == 4 and len(sub.arrays) == 1 and len(sub_bad.submitted) == 1
    finish(sub.jobs)
    with pytest.raises(submitit.core.utils.FailedJobError):
        sub_bad.jobs[0].result()

    for d in sub.submitted:
        assert RunDir(d.out).state() == "done" and n_rows(d.out) == 4
        assert RunDir(d.out).job_record()["job_id"] == str(sub.jobs[sub.submitted.index(d)].job_id)
        meta = yaml.safe_load((d.out / "config.yaml").read_text())["meta"]
        assert meta == {**meta, **d.spec.meta}  # arm, point, seed, baseline, preset reach the analysis
    failed = sub_bad.submitted[0].out
    st = RunDir(failed).status()
    assert st["state"] == "failed" and "NSR_THREADS" in st["error"]

    # the result pickle comes a moment before the job ends; then sacct has the final states
    table = wait_for(lambda: all_ended(rows(good, out_root=tmp_path / "runs")), 60, "the jobs to end")
    assert {r["state"] for r in table} == {"done"} and {r["sacct"] for r in table} == {"COMPLETED"}
    assert [r["sacct"] for r in wait_for(lambda: all_ended(rows(bad, out_root=tmp_path / "runs")), 60, "")] == [
        "FAILED"
    ]

    capsys.readouterr()
    argv = ["--out-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs")]
    assert main([str(good), *argv]) == 0 and main([str(bad), *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("submitted 0 runs") == 2 and out.count("skip ") == 5
    assert "failed (--retry-failed reruns it)" in out
    again = submit(bad, retry_failed=True, dry_run=True, **kw)
    assert [d.reason for d in again.decisions] == ["failed, retrying"]


@pytest.mark.timeout(600)
def test_scancel_leaves_valid_files_and_shows_cancelled(tmp_path):
    sw = sweep_file(tmp_path, "cancel", "base: {train.steps: 200}\narms: {nsr: {loss.rule: nsr}}\n")
    sub = submit(sw, cluster="slurm", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
    d = sub.submitted[0]
    wait_for(lambda: n_rows(d.out) >= 3, 480, "the run to log 3 steps")  # incl. a first SFT warm start
    subprocess.run(["scancel", str(sub.jobs[0].job_id)], check=True)
    wait_for(lambda: RunDir(d.out).state() == "cancelled", 60, "status cancelled")
    assert sub.jobs[0].done(force_check=True)
    assert sub.jobs[0].get_info(mode="force")["State"].startswith("CANCELLED")

    st = json.loads((d.out / "status.json").read_text())
    assert st["state"] == "cancelled" and "signal 15" in st["error"]
    for name in ("metrics.jsonl", "eval.jsonl"):  # every line complete JSON: nothing half-written
        for line in (d.out / name).read_text().splitlines():
            json.loads(line)
    assert yaml.safe_load((d.out / "config.yaml").read_text())["meta"]["run_id"] == d.spec.run_id
    assert not [p.name for p in d.out.iterdir() if ".tmp" in p.name]
    assert [r["sacct"] for r in rows(sw, out_root=tmp_path / "runs")] == ["CANCELLED"]
    wait_for(lambda: squeue_state(str(sub.jobs[0].job_id)) == "", 60, "the job to leave the queue")
    (again,) = plan([d.spec], tmp_path / "runs", False, queue.live_jobs())
    assert again.submit and again.reason.startswith("cancelled")


@pytest.mark.timeout(1200)
def test_requeue_and_preemption_resume_to_the_same_metrics(tmp_path):
    sw = sweep_file(tmp_path, "resume", "base: {train.steps: 60}\narms: {nsr: {loss.rule: nsr}}\n")
    subs = {
        name: submit(sw, cluster="slurm", out_root=tmp_path / name, log_dir=tmp_path / "logs")
        for name in ("reference", "requeue", "preempt")
    }
    out = {name: s.submitted[0].out for name, s in subs.items()}
    interrupt = {  # scontrol requeue: SIGTERM, then SLURM starts the job again; USR2: submitit's preemption path
        "requeue": lambda job: ["scontrol", "requeue", job],
        "preempt": lambda job: ["scancel", "--signal=USR2", job],
    }

    def told(name, job):  # what a timed-out wait on this run reports
        return lambda: job_story(out[name], job, tmp_path / "logs")

    for name, cmd in interrupt.items():
        # past step 10, so the run resumes from its checkpoint, not from scratch
        wait_for(lambda n=name: n_rows(out[n]) >= 12 and (out[n] / "checkpoint.pt").exists(), 480, f"{name} step 12")
        job = RunDir(out[name]).status()["slurm_job_id"]
        subprocess.run(cmd(job), check=True)
        wait_for(lambda n=name: RunDir(out[n]).state() == "cancelled", 60, f"{name} to stop", told(name, job))
        wait_for(lambda j=job: squeue_state(j) == "PENDING", 60, f"{name} to be queued again", told(name, job))
        # SLURM holds a requeued job ~2 minutes (BeginTime); let it start now
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
    for s in subs.values():
        finish(s.jobs)
    for name in interrupt:
        # the folder's own end state, not only submitit's handle: the handle counts a job finished at its result
        # pickle or at a final sacct state (between the attempts sacct reads REQUEUED, then PENDING: not final), so
        # it returns before the run is done only if a second attempt ends without finishing it; the folder then
        # stays `cancelled`, and the story says where the job stood
        job = RunDir(out[name]).status()["slurm_job_id"]
        wait_for(
            lambda n=name, j=job: RunDir(out[n]).state() in ("done", "failed") and squeue_state(j) == "",
            480,
            f"{name} to end",
            story=told(name, job),
        )

    ref = metrics(out["reference"])
    assert len(ref) == 60 and RunDir(out["reference"]).status()["attempts"] == 1
    for name in interrupt:
        st = RunDir(out[name]).status()
        assert st["state"] == "done" and st["attempts"] == 2, st
        assert metrics(out[name]) == ref  # every field but wall_s, every step
        assert not [p.name for p in out[name].iterdir() if ".tmp" in p.name]  # no half-written file left
        with (
            gzip.open(out[name] / "eval.jsonl.gz", "rt") as a,
            gzip.open(out["reference"] / "eval.jsonl.gz", "rt") as b,
        ):
            assert a.read() == b.read()


@pytest.mark.timeout(600)
def test_trl_run_saves_and_stops_on_scancel_usr1(tmp_path):
    """`scancel --signal=USR1` reaches a trl-backend run inside its submitit job: it saves a checkpoint at the end of
    the step under way (none is due: checkpoint_every 0) and ends cancelled; the resubmission resumes from there."""
    sw = tmp_path / "usr1.yaml"
    sw.write_text(
        "name: usr1\npreset: trl-tiny\narms: {nsr: {loss.rule: nsr}}\nbase: {train.steps: 40, "
        "logging.checkpoint_every: 0, eval.n_prompts: 16, eval.n_samples: 1, sft.steps: 150, sft.warmup: 50}\n"
    )
    sub = submit(sw, cluster="slurm", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
    (d,) = sub.submitted
    wait_for(lambda: n_rows(d.out) >= 2, 420, "step 2")
    job = RunDir(d.out).status()["slurm_job_id"]
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_for(lambda: RunDir(d.out).state() == "cancelled" and squeue_state(job) == "", 120, "the run to stop")
    st, rows_ = RunDir(d.out).status(), n_rows(d.out)
    assert "SIGUSR1" in st["error"] and 2 <= rows_ < 40, (st, rows_)
    ckpt = latest_checkpoint(RunDir(d.out))
    assert ckpt is not None and checkpoint_rl_step(ckpt, d.spec.config) == rows_  # saved at the step it stopped
    (again,) = plan([d.spec], tmp_path / "runs", False, queue.live_jobs())
    assert again.submit and again.reason.startswith("cancelled")


@pytest.mark.timeout(600)
def test_slurm_stop_saves_a_job_and_a_process_where_each_stands(tmp_path, capsys):
    """`python -m slurm.stop SWEEP`: a trl run in a SLURM job gets `scancel --signal=USR1`, one started by hand on
    this host gets USR1 from its pid; each saves at the end of its step (no periodic checkpoint is due) and ends
    cancelled, and the process exits 143. A run whose attempt records no save signal would get SIGTERM. The runs are
    long (400 steps) so that neither ends while the other starts: under load the job can start a minute later."""
    sw = tmp_path / "halt.yaml"
    sw.write_text(
        "name: halt\npreset: trl-tiny\narms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}\n"
        "base: {train.steps: 400, logging.checkpoint_every: 0, eval.n_prompts: 16, eval.n_samples: 1, sft.steps: 150, "
        "sft.warmup: 50}\n"
    )
    root = tmp_path / "runs"
    in_job, by_hand = expand(sw)
    submit(sw, cluster="slurm", only=[in_job.run_id], out_root=root, log_dir=tmp_path / "logs")
    folder = {s.run_id: root / s.sweep / s.run_id for s in (in_job, by_hand)}
    cmd = [sys.executable, "-m", "experiments.run", "--sweep", str(sw), "--run", by_hand.run_id, "--out"]
    proc = subprocess.Popen([*cmd, str(folder[by_hand.run_id]), "--no-progress"], cwd=ROOT)
    try:
        for f in folder.values():
            wait_for(lambda f=f: n_rows(f) >= 2, 420, f"{f.name} step 2")
        assert stop.main([str(sw), "--out-root", str(root), "--dry-run"]) == 0
        said = capsys.readouterr().out
        job = RunDir(folder[in_job.run_id]).job_id()
        assert f"would send scancel SIGUSR1 {job}" in said and f"would send kill SIGUSR1 {proc.pid}" in said
        assert stop.main([str(sw), "--out-root", str(root), "--wait", "300"]) == 0
        assert "cancelled after" in capsys.readouterr().out and proc.wait(60) == 143
    finally:
        proc.kill()
    for spec in (in_job, by_hand):
        rd = RunDir(folder[spec.run_id])
        assert rd.state() == "cancelled" and "SIGUSR1" in rd.status()["error"]
        assert checkpoint_rl_step(latest_checkpoint(rd), spec.config) == n_rows(rd.path) < 400
    assert stop.main([str(sw), "--out-root", str(root)]) == 0  # nothing runs now: nothing is sent
    assert "sent" not in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_local_and_debug_executors_run_without_slurm(tmp_path):
    sw = sweep_file(
        tmp_path,
        "here",
        "base: {train.steps: 2, eval.every: 1}\narms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}\n",
    )
    specs = expand(sw)
    kw = {"out_root": tmp_path / "runs", "log_dir": tmp_path / "logs"}
    local = submit(sw, cluster="local", max_parallel=1, only=[specs[0].run_id], **kw)
    debug = submit(sw, cluster="debug", only=[specs[1].run_id], **kw)
    for sub, cluster in ((local, "local"), (debug, "debug")):
        (d,) = sub.submitted
        assert RunDir(d.out).state() == "done" and n_rows(d.out) == 2
        assert RunDir(d.out).job_record()["cluster"] == cluster
    assert [d.submit for d in submit(sw, cluster="local", dry_run=True, **kw).decisions] == [False, False]


@pytest.mark.timeout(300)
def test_ray_head_and_worker_join_inside_an_allocation():
    """Two tasks of one allocation: task 0 starts the head, task 1 joins, the payload sees both; nothing is left."""
    cmd = ["srun", "-N1", "-n2", "--mem=4G", "--time=5", sys.executable, "-m", "slurm.ray_cluster"]
    env = {**os.environ, "NSR_RAY_PORT": "6391"}  # the job's python imports the installed package
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280, check=False, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["nodes"] == 2 and summary["address"].endswith(":6391") and summary["resources"]["CPU"] > 0
    left = subprocess.run(["pgrep", "-f", ":6391"], capture_output=True, text=True, check=False)
    assert left.stdout.strip() == ""  # no Ray process of this cluster (port 6391) survives the job


def _sbatch_held(cancel: bool = True) -> str:
    """A real job that never starts: submitted held, then cancelled (unless ``cancel`` is False: it stays held)."""
    p = subprocess.run(
        ["sbatch", "--hold", "--parsable", "--time=1", "--mem=100M", "--output=/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    )
    job = p.stdout.strip().split(";")[0]
    if cancel:
        subprocess.run(["scancel", job], check=True)
    return job


@pytest.mark.timeout(180)
def test_status_names_held_jobs_and_the_nodes_that_start_none(tmp_path, capsys):
    """A held job never starts by itself: a queued and a running folder whose job SLURM holds read `held (reason)`
    (one whose process holds its lock stays running); released, the hold is gone. A drained node (a full disk drains
    one: `SlurmdSpoolDir is full`, with every job it failed to launch held) is named with its reason and the command
    that resumes it."""
    sw = sweep_file(
        tmp_path, "held", "base: {train.steps: 2}\narms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}\n"
    )
    queued, requeued = expand(sw)
    root = tmp_path / "runs"
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()[
        0
    ]
    jobs = []
    try:
        for spec in (queued, requeued):
            folder = root / spec.sweep / spec.run_id
            RunDir(folder).write_config(spec.config, run_id=spec.run_id)
            jobs.append(_sbatch_held(cancel=False))
            (folder / "slurm.json").write_text(json.dumps({"job_id": jobs[-1], "cluster": "slurm"}))
        RunDir(root / requeued.sweep / requeued.run_id).set_status(
            "running"
        )  # as after a requeue that failed to launch
        assert {j: r for j, r in queue.held_jobs().items() if j in jobs} == dict.fromkeys(jobs, "JobHeldUser")
        assert [r["state"] for r in rows(sw, out_root=root)] == ["held (JobHeldUser)"] * 2
        with RunDir(root / requeued.sweep / requeued.run_id).lock():
            assert [r["state"] for r in rows(sw, out_root=root)] == ["held (JobHeldUser)", "running"]
        subprocess.run(["scontrol", "release", jobs[0]], check=True)
        wait_for(lambda: jobs[0] not in queue.held_jobs(), 30, "the release to lift the hold")
        assert not rows(sw, out_root=root)[0]["state"].startswith("held")

        assert queue.node_problems() == []
        reason = "nsr test: disk full"
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"], check=True)
        assert wait_for(queue.node_problems, 30, "sinfo to show the drain") == [f"{node} drained: {reason}"]
        capsys.readouterr()
        assert status_main([str(sw), "--out-root", str(root)]) == 0
        out = capsys.readouterr().out
        resume = f"scontrol update nodename={node} state=resume"
        assert f"SLURM node {node} drained: {reason} (no job starts there; once fixed: {resume})" in out
        assert "held (JobHeldUser)" in out
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        for job in jobs:
            subprocess.run(["scancel", job], check=False)
    assert wait_for(lambda: _cluster_up() and not queue.node_problems(), 30, "the node to take jobs again")


@pytest.mark.timeout(180)
def test_status_shows_sacct_state_of_jobs_that_ended_without_the_run(tmp_path):
    """A folder whose job was cancelled before it started read `queued`; a `running` folder whose job is gone read
    `running`. Both now say what sacct says."""
    sw = sweep_file(
        tmp_path, "gone", "base: {train.steps: 2}\narms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}\n"
    )
    never, killed = expand(sw)
    root = tmp_path / "runs"
    for spec in (never, killed):
        folder = root / spec.sweep / spec.run_id
        RunDir(folder).write_config(spec.config, run_id=spec.run_id)  # as slurm.submit leaves it
        (folder / "slurm.json").write_text(json.dumps({"job_id": _sbatch_held(), "cluster": "slurm"}))
    RunDir(root / killed.sweep / killed.run_id).set_status("running")  # its job died without a word (kill -9)

    def recorded(table):  # sacct lists a job only once slurmdbd has it ("-" until then)
        return table if all(r["sacct"] not in (*queue.LIVE_STATES, "-") for r in table) else None

    table = wait_for(lambda: recorded(rows(sw, out_root=root)), 60, "sacct to record the cancellations")
    assert [r["sacct"] for r in table] == ["CANCELLED", "CANCELLED"]
    assert [r["state"] for r in table] == ["not started (job CANCELLED)", "stopped (job CANCELLED)"]
    with RunDir(root / killed.sweep / killed.run_id).lock():  # restarted by hand (experiments.run): it holds the folder
        assert [r["state"] for r in rows(sw, out_root=root)] == ["not started (job CANCELLED)", "running"]


@pytest.mark.timeout(600)
def test_a_config_shared_by_two_sweeps_runs_once(tmp_path, capsys):
    shared = "base: {train.steps: 2, eval.every: 0}\n"
    a = sweep_file(tmp_path, "first", shared + "arms: {hard: {loss.rule: hard}}\n")
    b = sweep_file(tmp_path, "second", shared + "arms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}\n")
    kw = {"cluster": "slurm", "out_root": tmp_path / "runs", "log_dir": tmp_path / "logs"}
    sub_a = submit(a, **kw)
    (first,) = sub_a.submitted
    sub_b = submit(b, **kw)  # while the first sweep's job is queued or running
    got = {d.spec.meta["arm"]: d for d in sub_b.decisions}
    assert not got["hard"].submit and str(first.out) in got["hard"].reason, got["hard"].reason
    assert got["nsr"].submit
    finish(sub_a.jobs + sub_b.jobs)
    assert RunDir(first.out).state() == "done" and not got["hard"].out.exists()
    again = submit(b, dry_run=True, **kw)
    assert {d.spec.meta["arm"]: d.reason for d in again.decisions} == {
        "hard": f"done in {first.out} (the same config)",
        "nsr": "done",
    }
    table = {r["arm"]: r for r in rows(b, out_root=tmp_path / "runs")}  # status shows where the shared run is
    assert table["hard"]["state"] == "done" and table["hard"]["in"] == str(first.out.relative_to(tmp_path / "runs"))
    assert table["nsr"]["in"] == "" and table["hard"]["wall_s"] > 0


def test_status_progress_line_and_eta():
    def row(state, wall=None):
        return {"state": state, "wall_s": wall}

    assert progress([row("done", 100.0), row("-")]) == ""  # nothing running: no progress line
    table = [row("done", 100.0), row("done", 140.0), row("done", 120.0), row("running"), row("running"), row("-")]
    # 3 runs left at 2 running: 2 rounds of the median 120 s
    assert progress(table) == "progress: 3/6 done, 2 running, ETA ~4 min (median run 120 s)"
    # a held run waits on someone: like a failed one, it is not among the runs left in the ETA
    assert progress([*table, row("held (JobHeldUser)")]).startswith("progress: 3/7 done, 2 running, ETA ~4 min")
    assert progress([row("running"), row("-")]) == "progress: 0/2 done, 1 running"  # no finished run: no ETA
    # with recent finish times the pace of the last finishes counts, not the number running at this moment
    paced = [{"state": "done", "wall_s": 120.0, "finished": 1000.0 + 60 * i} for i in range(4)]
    paced += [row("running")] + [row("-")] * 5  # 6 left, one finished every 60 s -> 6 min, though 1 runs now
    assert (
        progress(paced, now=1200.0) == "progress: 4/10 done, 1 running, ETA ~6 min (one run finished every 60 s lately)"
    )
    # finishes long ago (an earlier session) do not set the pace
    assert progress(paced, now=100000.0).endswith("ETA ~12 min (median run 120 s)")


@pytest.mark.timeout(600)
def test_a_sweep_packed_into_batches_runs_each_config_once(tmp_path, capsys):
    """Compatible tiny runs go to one SLURM task each batch (experiments.run.run_batch): 3 runs in 2 tasks of at most
    2; every folder is done with its own rows and records the task that ran it; sacct says COMPLETED; resubmitting
    sends nothing, and a single run of the same sweep, submitted unbatched, is skipped (a config runs once)."""
    sw = sweep_file(
        tmp_path,
        "packed",
        """
        base: {train.steps: 4, eval.every: 2}
        arms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}, soft: {loss.rule: soft}}
        baseline: hard
        """,
    )
    site = tmp_path / "site.yaml"
    site.write_text("presets:\n  tiny-smoke: {time_min: 10, setup: []}\n")
    kw = {"cluster": "slurm", "out_root": tmp_path / "runs", "log_dir": tmp_path / "logs", "site": site}
    sub = submit(sw, batch_size=2, **kw)
    assert len(sub.submitted) == 3 and sub.tasks == 2 and len(sub.jobs) == 2
    finish(sub.jobs)
    jobs = {str(j.job_id) for j in sub.jobs}
    for d in sub.submitted:
        rd = RunDir(d.out)
        assert rd.state() == "done" and n_rows(d.out) == 4 and rd.job_record()["job_id"] in jobs
    table = wait_for(lambda: all_ended(rows(sw, out_root=tmp_path / "runs")), 60, "the tasks to end")
    assert {r["state"] for r in table} == {"done"} and {r["sacct"] for r in table} == {"COMPLETED"}
    again = submit(sw, batch_size=1, **kw)
    assert again.submitted == [] and {d.reason for d in again.decisions} == {"done"}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_smollm2_trl_run_requests_no_gpu_and_ends_done_on_slurm(tmp_path, capsys):
    """`python -m slurm.submit SWEEP --preset smollm2-trl-cpu`: the dry run shows the preset's own resources (2 CPUs,
    no GPU), and one 2-step run (a small batch) ends done on the local SLURM, whose job was granted those CPUs and no
    GPU (sacct's AllocTRES)."""
    sw = tmp_path / "smol.yaml"
    body = f"base: {{{SMOLLM2_SMALL}}}\narms: {{nsr: {{loss.rule: nsr}}}}\n"
    sw.write_text("name: smol\npreset: smollm2-trl-cpu\n" + body)
    kw = ["--out-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs")]
    assert main([str(sw), "--dry-run", *kw]) == 0
    out = capsys.readouterr().out
    assert re.search(r"resources smollm2-trl-cpu: 1 node\(s\), 2 CPUs, [\d.]+ GB, \d+ min, no GPU", out), out
    sub = submit(sw, cluster="slurm", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
    (d,) = sub.submitted
    finish(sub.jobs)
    rd = RunDir(d.out)
    assert rd.state() == "done", rd.status()
    assert n_rows(d.out) == 2
    job = str(sub.jobs[0].job_id)
    tres = wait_for(lambda: _alloc_tres(job), 60, "sacct's AllocTRES")
    assert "cpu=2" in tres and "gpu" not in tres, tres
