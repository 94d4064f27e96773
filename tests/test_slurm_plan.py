"""slurm.submit without a cluster: what a resubmission does with each run folder, the site file, --dry-run and
bad input (nothing is submitted and no folder is made)."""

import json
import re
import textwrap
from pathlib import Path

import pytest

from experiments.config import ConfigError
from experiments.rundir import RunDir
from experiments.sweep import expand
from slurm import queue
from slurm.submit import load_site, main, plan, resources, submit


@pytest.fixture
def specs():
    return expand("rescue_vs_decay", preset="tiny-smoke")  # 6 arms, one seed


def folder(root, spec):
    return root / spec.sweep / spec.run_id


def record(root, spec, job_id):
    d = folder(root, spec)
    d.mkdir(parents=True, exist_ok=True)
    (d / "slurm.json").write_text(json.dumps({"job_id": job_id, "cluster": "slurm"}))


def test_plan_decides_from_folders_and_live_jobs(tmp_path, specs):
    hard, nsr, soft, pushout, nsr_pushout, widened = specs
    RunDir(folder(tmp_path, hard)).set_status("done")
    RunDir(folder(tmp_path, nsr)).set_status("failed", error="boom")
    RunDir(folder(tmp_path, soft)).set_status("running")
    record(tmp_path, soft, "7_2")  # its job is gone: resubmit, it resumes
    RunDir(folder(tmp_path, pushout)).set_status("running")
    record(tmp_path, pushout, "7_3")  # still running
    record(tmp_path, nsr_pushout, "7_4")  # queued, not started
    RunDir(folder(tmp_path, widened)).set_status("cancelled")
    live = {"7_3": "RUNNING", "7_4": "PENDING"}

    got = {d.spec.meta["arm"]: (d.submit, d.reason) for d in plan(specs, tmp_path, False, live)}
    assert got == {
        "hard": (False, "done"),
        "nsr": (False, "failed (--retry-failed reruns it)"),
        "soft": (True, "running, job 7_2 gone: resumes"),
        "pushout": (False, "job 7_3 is RUNNING"),
        "nsr_pushout": (False, "job 7_4 is PENDING"),
        "widened": (True, "cancelled: resumes"),
    }
    retry = {d.spec.meta["arm"]: d.submit for d in plan(specs, tmp_path, True, {})}
    assert retry == {"hard": False, "nsr": True, "soft": True, "pushout": True, "nsr_pushout": True, "widened": True}


def test_plan_uses_status_job_ids_and_folder_locks(tmp_path, specs):
    hard, nsr = specs[:2]
    st = RunDir(folder(tmp_path, hard))
    st.set_status("running", slurm_array_job_id="9", slurm_array_task_id="0")  # written by a job, no slurm.json
    with RunDir(folder(tmp_path, nsr)).lock():  # experiments.run holds the folder in this process
        RunDir(folder(tmp_path, nsr)).set_status("running")
        got = {d.spec.meta["arm"]: d.reason for d in plan(specs[:2], tmp_path, False, {"9_0": "RUNNING"})}
    assert got == {"hard": "job 9_0 is RUNNING", "nsr": "running here (its folder is locked)"}
    after = {d.spec.meta["arm"]: d.submit for d in plan(specs[:2], tmp_path, False, {})}
    assert after == {"hard": True, "nsr": True}


def test_a_new_attempt_records_only_its_own_slurm_job(tmp_path, specs, monkeypatch):
    rd = RunDir(folder(tmp_path, specs[0]))
    for key, value in (("SLURM_JOB_ID", "55"), ("SLURM_ARRAY_JOB_ID", "54"), ("SLURM_ARRAY_TASK_ID", "0")):
        monkeypatch.setenv(key, value)
    rd.set_status("running")
    assert rd.job_id() == "54_0"
    rd.set_status("cancelled", error="Cancelled")  # the same attempt ends: its job stays on record
    assert rd.status()["slurm_job_id"] == "55"
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key)
    rd.set_status("running")  # restarted by hand, outside SLURM: the old job is not this attempt's
    st = rd.status()
    assert st["attempts"] == 2 and rd.job_id() is None
    assert not any(k.startswith("slurm_") for k in st)


def test_every_attempts_thread_count_is_kept(tmp_path):
    # float rounding follows the thread count: a run resumed at another count is no rerun at any one count
    rd = RunDir(tmp_path / "run")
    rd.set_status("running", threads=2)  # a SLURM attempt (NSR_THREADS = the task's CPUs)
    rd.set_status("cancelled")
    assert rd.status()["thread_counts"] == [2]
    rd.set_status("running", threads=1)  # resumed by hand with the default
    st = rd.status()
    assert st["threads"] == 1 and st["thread_counts"] == [1, 2] and st["attempts"] == 2
    rd.set_status("running")  # a backend that trains in another process records none
    assert "threads" not in rd.status() and rd.status()["thread_counts"] == [1, 2]


def test_stop_sends_usr1_only_where_the_attempt_saves_on_it(tmp_path, specs):
    import os
    from contextlib import ExitStack

    from slurm.stop import actions

    saves, plain, idle, queued, starting, requeued = (RunDir(folder(tmp_path, s)) for s in specs[:6])
    for rd in (saves, starting, requeued):
        rd.set_status("running", save_signal="USR1")  # as experiments.run records a trl attempt
    plain.set_status("running")  # a tiny run, or a trl process started before the field existed
    idle.set_status("running")  # on record only: no process holds it

    def row(run_id, rd, state, job, where=""):
        return {"run_id": run_id, "folder": str(rd.path), "state": state, "job": job, "in": where}

    table = [
        row("saves", saves, "running", "5_0"),
        row("plain", plain, "running", None),
        row("idle", idle, "running", None),
        row("queued", queued, "queued", "5_3"),
        row("starting", starting, "running", "5_4"),  # its job runs, but it does not hold its folder yet
        row("requeued", requeued, "running", "5_5"),  # killed hard, its job queued again
        row("batch-mate", plain, "running", None),  # a second run of plain's batched task: the same process
        row("shared", saves, "running", "5_0", where="other/saves"),  # its config runs in another sweep's folder
    ]
    live = {"5_0": "RUNNING", "5_3": "PENDING", "5_4": "RUNNING", "5_5": "PENDING"}
    with ExitStack() as held:
        for rd in (saves, plain, requeued):
            held.enter_context(rd.lock())
        got = {a["run_id"]: (a["how"], a["target"], a["signal"]) for a in actions(table, live=live)}
        now = {a["run_id"]: a["signal"] for a in actions(table, now=True, live=live)}
        shared = {a["run_id"]: a["how"] for a in actions(table, live=live, shared=True)}
    assert got == {
        "saves": ("scancel", "5_0", "USR1"),
        "plain": ("kill", str(os.getpid()), "TERM"),
        "idle": ("none", "", ""),
        "queued": ("scancel", "5_3", "TERM"),
        "starting": ("scancel", "5_4", "TERM"),
        "requeued": ("scancel", "5_5", "TERM"),
        "batch-mate": ("none", "", ""),
        "shared": ("none", "", ""),
    }
    assert set(now.values()) == {"TERM", ""}
    assert shared["shared"] == "none"  # with --shared it is reached, but job 5_0 was signalled for "saves" already
    saves.set_status("running")  # a new attempt records its own save signal, or none
    assert "save_signal" not in saves.status()


def test_stop_reaches_requeued_jobs_and_names_the_runs_it_leaves_running(tmp_path, specs, capsys):
    import json
    import os
    from contextlib import ExitStack

    from slurm.stop import actions
    from slurm.stop import main as stop_main

    back, back_failed, done, elsewhere, blind, stale = (RunDir(folder(tmp_path, s)) for s in specs[:6])
    back.set_status("cancelled")  # stopped, and its job requeued (preemption): the job is live again
    back_failed.set_status("failed")
    done.set_status("done")
    for rd in (elsewhere, blind, stale):
        rd.set_status("running", save_signal="USR1")
    record = json.loads(elsewhere.status_path.read_text())
    elsewhere.status_path.write_text(json.dumps({**record, "host": "node17"}))  # held on another host
    record = json.loads(stale.status_path.read_text())
    stale.status_path.write_text(json.dumps({**record, "pid": os.getppid()}))  # an old attempt's record

    def row(run_id, rd, state, job):
        return {"run_id": run_id, "folder": str(rd.path), "state": state, "job": job, "in": ""}

    table = [
        row("back", back, "cancelled", "6_0"),
        row("back-failed", back_failed, "failed", "6_1"),
        row("done", done, "done", "6_2"),
        row("elsewhere", elsewhere, "running", None),
        row("blind", blind, "running", "6_4"),
        row("stale", stale, "running", None),
    ]
    with ExitStack() as held:
        for rd in (elsewhere, blind, stale):  # this process holds them, as a run's process would
            held.enter_context(rd.lock())
        assert stale.holder_pid() == os.getpid() != stale.status()["pid"]
        got = {a["run_id"]: a for a in actions(table, live={"6_0": "RUNNING", "6_1": "PENDING", "6_2": "RUNNING"})}
        blind_act = {a["run_id"]: a for a in actions(table, live=None)}["blind"]
    assert [got[r]["how"] for r in ("back", "back-failed")] == ["scancel", "scancel"]
    assert got["back"]["signal"] == "TERM" and "requeued attempt" in got["back"]["why"]
    assert got["done"]["how"] == "none" and not got["done"]["left_running"]
    assert got["elsewhere"]["how"] == "none" and "on node17 outside SLURM" in got["elsewhere"]["why"]
    assert got["stale"]["how"] == "none" and f"held by process {os.getpid()}" in got["stale"]["why"]
    assert blind_act["how"] == "none" and "squeue cannot be read" in blind_act["why"]
    assert all(a["left_running"] for a in (got["elsewhere"], got["stale"], blind_act))

    # the command: a run left running makes exit 1 and is named; a --wait that is no number of seconds is bad input
    argv = ["rescue_vs_decay", "--preset", "tiny-smoke", "--out-root", str(tmp_path), "--dry-run"]
    with elsewhere.lock():
        assert stop_main(argv) == 1
    assert "still running: " + specs[3].run_id in capsys.readouterr().err
    assert stop_main(argv) == 0  # nobody holds it now: nothing runs
    assert stop_main([*argv, "--wait", "nan"]) == 2 and "--wait=nan is not valid" in capsys.readouterr().err


def test_array_ranges_are_expanded():
    assert queue.expand_ids("7_[2-4,9%2]") == ["7_2", "7_3", "7_4", "7_9"]
    assert queue._parse("7_1|CANCELLED by 0\n7_[2-3]|PENDING\n8|RUNNING\n") == {
        "7_1": "CANCELLED",
        "7_2": "PENDING",
        "7_3": "PENDING",
        "8": "RUNNING",
    }


def test_site_file_resources(tmp_path):
    site = load_site()  # the shipped slurm/cluster.yaml
    tiny = expand("delta", preset="tiny")[0]
    assert resources(site, "tiny", tiny)["time_min"] >= 2
    big = expand("main")[0]  # openrlhf: nodes and GPUs come from the preset's config
    res = resources(site, big.meta["preset"], big)
    assert (res["nodes"], res["gpus_per_node"]) == (big.config.openrlhf.nodes, big.config.openrlhf.gpus_per_node)

    bad = tmp_path / "site.yaml"
    bad.write_text("presets:\n  tiny: {cpu: 2}\n")
    with pytest.raises(ConfigError, match=r"site\.yaml: presets\.tiny: unknown key 'cpu'; allowed: partition"):
        load_site(bad)
    bad.write_text("default: {time_min: 1}\n")
    with pytest.raises(ConfigError, match=r"default\.time_min=1 is not valid; allowed: >= 2"):
        load_site(bad)
    bad.write_text(f"presets:\n  {big.meta['preset']}: {{gpus_per_node: 3}}\n")
    with pytest.raises(ConfigError, match=r"gpus_per_node=3 for preset .* openrlhf\.gpus_per_node=\d+; allowed: \d+"):
        resources(load_site(bad), big.meta["preset"], big)


def test_dry_run_lists_runs_and_creates_nothing(tmp_path, capsys):
    rc = main(["delta", "--preset", "tiny-smoke", "--dry-run", "--out-root", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    ids = [r.run_id for r in expand("delta", preset="tiny-smoke")]
    assert rc == 0 and all(f"would submit {i}" in out for i in ids)
    assert "loss.rule=nsr loss.delta=0.05 seed=0" in out and f"dry run: {len(ids)} runs" in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["delta", "--preset", "tiny", "--only", "nsr-delta9-s0-00000000"], r"--only 'nsr-delta9-s0-00000000' is not"),
        (["delta", "--preset", "nope"], r"preset='nope' not found; allowed: .*tiny-smoke"),
        (["delta", "--preset", "tiny", "--max-parallel", "0"], r"max_parallel=0 is not valid; allowed: >= 1"),
    ],
)
def test_bad_input_submits_nothing(tmp_path, capsys, argv, message):

    rc = main([*argv, "--out-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err), err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


def test_bad_sweep_value_submits_nothing(tmp_path):
    sw = tmp_path / "bad.yaml"
    sw.write_text(
        textwrap.dedent("""
        preset: tiny-smoke
        arms: {ok: {loss.rule: nsr}, bad: {loss.rule: nsr, loss.delta: 2.0}}
        """)
    )
    with pytest.raises(ConfigError, match=r"bad\.yaml: run bad-s0 .*loss\.delta=2\.0 is not valid; allowed: .*0 <="):
        submit(sw, cluster="slurm", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


def test_dry_run_prints_the_resource_plan_of_every_openrlhf_run(capsys):
    from experiments.openrlhf.plan import plan_run

    specs = expand("main")
    short = [s.run_id for s in specs if not plan_run(s.config).rows_ok]  # no training data in a fresh checkout
    assert main(["main", "--dry-run"]) == (2 if short else 0)
    out = capsys.readouterr().out
    ids = [s.run_id for s in specs]
    plan_lines = [line for line in out.splitlines() if line.startswith("plan ") and not line.startswith("plan total")]
    assert sorted(line.split(":")[0][5:] for line in plan_lines) == sorted(ids)
    assert all(
        re.search(r"rows (\d+|no file)/\d+.*GPU-h [\d,]+ per allocation.*disk peak [\d,]+ GB", x) for x in plan_lines
    )
    assert re.search(rf"plan total: {len(ids)} openrlhf runs, GPU-h [\d,]+ of allocations", out)


def test_submit_refuses_openrlhf_runs_short_of_data_rows(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n' * 10)  # 10 rows; the 7B preset's 400 steps need far more
    sw = tmp_path / "short.yaml"
    sw.write_text(f"preset: qwen2.5-math-7b-dapo\nbase: {{task.train_data: {data}}}\narms: {{hard: {{}}}}\n")
    want = r"1 runs short of training prompt rows \(e\.g\. hard-s0-\w+ needs \d+ and finds 10 rows: .*\); "
    with pytest.raises(ConfigError, match=want + r"nothing was submitted; fix: write \d+ prompt rows to"):
        submit(sw, cluster="local", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
    assert not (tmp_path / "logs").exists()


def test_dry_run_exits_as_the_submit_would_and_says_why_and_the_fix(tmp_path, capsys):
    """A dry run of runs the submit refuses: each run line says refused and why, the last line how many, why and the
    command that fixes it, exit 2 (the submit's); nothing is written. Runs of the cluster preset on a training file
    named after experiments.openrlhf.data's source: its command; a template sweep: what to do."""
    from experiments.openrlhf.plan import rows_needed

    data = tmp_path / "data" / "dapo-math-17k.jsonl"
    sw = tmp_path / "short.yaml"
    arms = "arms: {hard: {}, nsr: {loss.rule: nsr}}"
    sw.write_text(f"preset: qwen2.5-math-7b-dapo\nbase: {{task.train_data: {data}}}\n{arms}\n")
    argv = [str(sw), "--dry-run", "--out-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs")]
    assert main(argv) == 2
    out = capsys.readouterr().out.splitlines()
    specs = expand(sw)
    need = rows_needed(specs[0].config)
    for s in specs:
        (line,) = [x for x in out if x.startswith(("refused", "would")) and s.run_id in x]
        assert line.startswith("refused") and f"short of training prompt rows: needs {need}, finds no file" in line
    n = len(specs)
    assert out[-1] == (
        f"dry run: {n} runs; the submit would refuse {n} of them and submit nothing: {n} runs "
        f"short of training prompt rows (e.g. {specs[0].run_id} needs {need} and finds no training data file: {data}); "
        f"fix: python -m experiments.openrlhf.data --only dapo-math-17k --out {data.parent} --rows {need}"
    )
    data.parent.mkdir()
    data.write_text('{"prompt": "1+1", "label": "2"}\n' * need)  # the fix: the dry run now says yes
    assert main(argv) == 0 and capsys.readouterr().out.splitlines()[-1].startswith(
        f"dry run: {len(specs)} runs, 2 would"
    )
    template = tmp_path / "template.yaml"
    template.write_text("status: template\npreset: tiny-smoke\narms: {hard: {}}\n")
    assert main([str(template), "--dry-run", "--out-root", str(tmp_path / "runs")]) == 2
    last = capsys.readouterr().out.splitlines()[-1]
    assert "the submit would refuse 1 of them" in last and last.endswith(
        "fix: fill in its values and set status: ready"
    )
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------- no sweep that fails after submission
def _every_sweep_and_preset():
    from experiments.sweep import SWEEPS_DIR, available, load_sweep

    for name in available(SWEEPS_DIR):
        sw = load_sweep(name)
        if sw.status == "template":
            continue
        for preset in (None,) if sw.preset_only else (None, "tiny", "tiny-regime"):
            yield name, preset


@pytest.mark.parametrize("name, preset", list(_every_sweep_and_preset()))
def test_every_run_of_every_sweep_passes_the_checks_of_its_start(name, preset):
    """What a job would refuse at its start (experiments.run.preflight: for the cluster, the argv builder and the
    launcher's own checks with OpenRLHF's parser) is refused at submission; every sweep file passes them, on its own
    preset(s) and on the CPU testbed's."""
    from experiments.sweep import expand
    from slurm.submit import check_runs

    check_runs(expand(name, preset=preset), name)


def test_a_preset_only_sweep_refuses_another_preset():
    """Stage R0 pins SmolLM2 and its task: on the CPU testbed's preset it is refused at expansion, naming the key and
    the allowed preset; on its own preset it expands."""
    from experiments.sweep import SweepError, expand

    with pytest.raises(SweepError, match=r"preset_only: .* preset='tiny' is refused; allowed: smollm2-trl-cpu"):
        expand("regime_r0", preset="tiny")
    assert {r.config.seed for r in expand("regime_r0", preset="smollm2-trl-cpu")} == {11, 12, 13}


def test_submission_names_each_run_that_would_fail_at_its_start(tmp_path):
    """A sweep whose random-reward arm keeps DAPO's dynamic filter (the backend refuses that control) is refused
    before any job or folder exists, run by run, in --dry-run too."""
    from experiments.config_errors import ConfigError
    from slurm.submit import submit

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "preset: qwen2.5-math-7b-dapo\nbase: {openrlhf.dynamic_filtering: true}\n"
        "arms: {task: {advantages.kind: group_norm}, random_reward: {advantages.kind: random_reward}}\nseeds: [0, 1]\n"
    )
    for dry in (True, False):
        with pytest.raises(ConfigError, match=r"2 of 4 runs would fail at their start") as e:
            submit(bad, dry_run=dry, cluster="local", out_root=tmp_path / "runs", log_dir=tmp_path / "logs")
        assert "random_reward-s0-" in str(e.value) and "random_reward-s1-" in str(e.value)
        assert "dynamic filtering" in str(e.value) and "task-s0" not in str(e.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------- packing tiny runs into batched tasks
def test_pack_groups_compatible_tiny_runs():
    from experiments.sweep import expand
    from slurm.submit import Decision, pack

    specs = expand("delta", preset="tiny-smoke") + expand("regime_a2", preset="tiny-smoke")
    ds = [Decision(s, Path("/x") / s.run_id, True, "new") for s in specs]
    tasks = pack(ds, 4)
    assert sorted(d.spec.run_id for t in tasks for d in t) == sorted(s.run_id for s in specs)  # each run once
    assert all(1 <= len(t) <= 4 for t in tasks)
    from experiments.tiny.batched import batch_key

    for t in tasks:  # one preset, one batch key per task
        assert len({(d.spec.meta["preset"], batch_key(d.spec.config)) for d in t}) == 1
    # delta's 13 runs share one key (4 tasks of <= 4, sized evenly: 4 3 3 3); regime_a2's candidates differ in
    # updates / samples (one task each)
    assert [len(t) for t in tasks[:4]] == [4, 3, 3, 3] and len(tasks) == 4 + 3
    assert all(len(t) == 1 for t in pack(ds, 1))
    cluster = expand("main")[:3]
    assert [len(t) for t in pack([Decision(s, Path("/x"), True, "") for s in cluster], 8)] == [1, 1, 1]


def test_nine_compatible_runs_pack_as_five_and_four_on_one_engine():
    """9 compatible tiny runs in tasks of at most 8: 5 + 4, both on the batched trainer (a sweep's arms from one
    engine), not 8 batched + 1 on the single-run trainer; other backends' runs stay alone on their own trainer."""
    from experiments.sweep import expand
    from slurm.jobs import BatchJob, RunJob
    from slurm.submit import Decision, _job, batched, pack

    specs = [s for s in expand("delta", preset="tiny-smoke")][:9]
    ds = [Decision(s, Path("/x") / s.run_id, True, "new") for s in specs]
    tasks = pack(ds, 8)
    assert [len(t) for t in tasks] == [5, 4]
    res = {"cpus_per_task": 1}
    assert all(isinstance(_job(t, res, batched(t, 8)), BatchJob) for t in tasks)
    assert [len(t) for t in pack(ds[:1], 8)] == [1] and isinstance(_job(ds[:1], res, batched(ds[:1], 8)), BatchJob)
    assert all(isinstance(_job(t, res, batched(t, 1)), RunJob) for t in pack(ds, 1))  # --batch-size 1: one engine too
    cluster = [Decision(s, Path("/x"), True, "") for s in expand("main")[:2]]
    assert all(isinstance(_job(t, res, batched(t, 8)), RunJob) for t in pack(cluster, 8))


def test_a_failing_member_of_a_packed_task_fails_alone(tmp_path, monkeypatch):
    """--cluster debug runs a packed task in this process: a loss that raises for one seed fails that run only; the
    batch's other runs finish; resubmitting sends only nothing (the failed one needs --retry-failed)."""
    from experiments.tiny import batched
    from slurm.submit import submit

    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path / "cache"))
    sw = tmp_path / "pk.yaml"
    sw.write_text(
        textwrap.dedent("""
        preset: tiny-smoke
        base: {train.steps: 3, eval.every: 0, eval.n_prompts: 16, sft.steps: 20, sft.warmup: 2}
        arms: {hard: {loss.rule: hard}, nsr: {loss.rule: nsr}}
        seeds: [0]
        """)
    )
    real = batched.nsr.policy_loss
    bad_seed = batched.generator(0, 2, "loss").initial_seed()

    def loss(lp, old, adv, m, cfg, generator=None):
        if cfg.rule == "nsr" and generator is not None and generator.initial_seed() == bad_seed:
            raise FloatingPointError("nsr broke")
        return real(lp, old, adv, m, cfg, generator=generator)

    monkeypatch.setattr(batched.nsr, "policy_loss", loss)
    kw = {"cluster": "debug", "out_root": tmp_path / "runs", "log_dir": tmp_path / "logs"}
    assert submit(sw, batch_size=8, dry_run=True, **kw).tasks == 1  # the dry run counts the tasks it would send
    sub = submit(sw, batch_size=8, **kw)
    assert sub.tasks == 1 and len(sub.submitted) == 2
    states = {d.spec.meta["arm"]: RunDir(d.out).status() for d in sub.submitted}
    assert states["hard"]["state"] == "done" and states["nsr"]["state"] == "failed"
    assert "nsr broke" in states["nsr"]["error"]
    again = submit(sw, batch_size=8, dry_run=True, **kw)
    assert again.submitted == [] and again.tasks == 0


def test_a_preset_carries_its_own_resources_and_the_site_entry_wins(tmp_path):
    presets = tmp_path / "presets"
    presets.mkdir()
    own = "preset:\n  max_seeds: 1\n  slurm: {cpus_per_task: 2, mem_gb: 6, time_min: 20}\nbackend: tiny\n"
    (presets / "mine.yaml").write_text(own + "train: {steps: 7}\n")
    spec = expand("delta", preset="mine", presets_dir=presets)[0]
    empty = {"path": tmp_path / "site.yaml", "default": {}, "presets": {}}
    res = resources(empty, "mine", spec)
    assert (res["cpus_per_task"], res["mem_gb"], res["time_min"], res["gpus_per_node"]) == (2, 6, 20, 0)
    # the site's default does not override a preset's measured needs; the site's entry for the preset does
    site = {**empty, "default": {"cpus_per_task": 1, "mem_gb": 2, "partition": "cpu"}}
    assert resources(site, "mine", spec) == {**res, "partition": "cpu"}
    site = {**empty, "presets": {"mine": {"time_min": 90}}}
    assert resources(site, "mine", spec)["time_min"] == 90

    (presets / "mine.yaml").write_text(own.replace("time_min: 20", "minutes: 20") + "train: {steps: 7}\n")
    spec = expand("delta", preset="mine", presets_dir=presets)[0]
    with pytest.raises(ConfigError, match=r"mine\.yaml: preset\.slurm: unknown key 'minutes'; allowed: cpus_per_task"):
        resources(empty, "mine", spec)
    (presets / "mine.yaml").write_text(own.replace("time_min: 20", "time_min: 1") + "train: {steps: 7}\n")
    spec = expand("delta", preset="mine", presets_dir=presets)[0]
    with pytest.raises(ConfigError, match=r"mine\.yaml: preset\.slurm\.time_min=1 is not valid; allowed: >= 2"):
        resources(empty, "mine", spec)


@pytest.mark.parametrize("preset", ["openrlhf-cpu", "smollm2-openrlhf-cpu", "smollm2-openrlhf-cpu-fp32"])
def test_a_cpu_openrlhf_preset_requests_no_gpu(tmp_path, capsys, preset):
    """openrlhf.cpu: the job asks for no GPU (the local SLURM has none), whatever openrlhf.gpus_per_node counts (the
    DeepSpeed ranks, CPU processes); a site entry asking for GPUs is refused naming the field."""
    spec = expand("delta", preset=preset)[0]
    assert spec.config.openrlhf.cpu and spec.config.openrlhf.gpus_per_node >= 1
    res = resources(load_site(), preset, spec)
    assert res["gpus_per_node"] == 0 and res["nodes"] == 1
    assert main(["delta", "--preset", preset, "--dry-run", "--out-root", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"resources {preset}: 1 node\(s\), \d+ CPUs, [\d.]+ GB, \d+ min, no GPU", out), out
    bad = tmp_path / "site.yaml"
    bad.write_text(f"presets:\n  {preset}: {{gpus_per_node: 1}}\n")
    with pytest.raises(ConfigError, match=r"gpus_per_node=1 .* is a CPU run \(openrlhf\.cpu=true\); allowed: 0"):
        resources(load_site(bad), preset, spec)
