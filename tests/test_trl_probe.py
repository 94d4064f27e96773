"""experiments.mechanism.trl (with its probe set and the backend's replay part, experiments.trl.replay), the paired
per-update test on the trl backend (stage R1's machinery), on a tiny Qwen2 folder (tests/trl_tiny.py) with the SmolLM2
preset's arithmetic task and its loop made small. The tiny model cannot answer, so the walks train on random rewards
(advantages.kind random_reward: every group has a signal) and the probe set keeps sampled completions whatever they say
(``verify``); the real set is verified by the kit's math reward (make-set)."""

import json
import os
import signal

import pytest

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import trl_tiny  # noqa: E402

from analysis import mechanism as stats  # noqa: E402
from experiments.config import load_config  # noqa: E402
from experiments.mechanism import probe_set  # noqa: E402
from experiments.mechanism import trl as trl_walk  # noqa: E402
from experiments.mechanism.plan import header, parse_rules  # noqa: E402
from experiments.run import run  # noqa: E402
from experiments.rundir import atomic_write_text  # noqa: E402

PRESET = "sweeps/presets/smollm2-trl-cpu.yaml"
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
         "eval.n_prompts=2", "eval.every=0", "train.steps=3", "logging.checkpoint_every=0",
         "advantages.kind=random_reward"]  # fmt: skip
CLIPS = ["train.minibatches=2", "train.lr=0.05"]  # the second minibatch is stale and the step is large: tokens clip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("probe")
    mp.setenv("NSR_CACHE_DIR", str(root / "cache"))  # the task files go here, not into the repo's cache/
    with trl_tiny.one_thread_frozen_gc():
        folder = trl_tiny.save_models(root / "models")["dense"]
        cfg = load_config(PRESET, [f"model.name={folder}", *SMALL, *CLIPS])
        rows, summary = probe_set.make_probe_set(cfg, 2, 6, 4, 2, 0, verify=lambda text, label: True)
        path = root / "set.jsonl"
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in [header("test", {}, **summary), *rows]))
        yield {"root": root, "cfg": cfg, "folder": folder, "set": path, "rows": rows, "summary": summary}
    mp.undo()


def _walk(env, name, cfg=None, steps=(1, 2, 3), check_replay=True):
    cfg = cfg or env["cfg"]
    out = env["root"] / f"{name}.jsonl"
    specs = parse_rules("soft,nsr", cfg.loss)
    lines = trl_walk.walk_run(cfg, env["root"] / name, specs, list(steps), probe_set.read_probe_set(env["set"]), out,
                           check_replay=check_replay)  # fmt: skip
    return lines, out


def _rows(folder, name):
    path = folder / name
    if not path.exists():
        import gzip

        return [json.loads(x) for x in gzip.open(f"{path}.gz", "rt").read().splitlines()]
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def walked(env):
    lines, out = _walk(env, "walk")
    run(env["cfg"], env["root"] / "plain", progress=False)
    return lines, out


def test_probed_walk_writes_the_plain_runs_folder(env, walked):
    walk, plain = env["root"] / "walk", env["root"] / "plain"
    for name in ("metrics.jsonl", "ratio_bins.jsonl", "eval.jsonl"):
        a, b = _rows(walk, name), _rows(plain, name)
        for row in a + b:
            row.pop("wall_s", None)
        assert a == b and a, name
    assert json.loads((walk / "status.json").read_text())["state"] == "done"


def test_replay_is_the_trainers_own_update_and_the_state_is_restored(walked):
    lines, _ = walked
    assert [x["step"] for x in lines] == [1, 2, 3]
    for x, nxt in zip(lines, lines[1:] + [None]):
        # replaying hard from the saved state gives the baseline's next weights, bit for bit
        assert x["digest"]["hard_replay"] == x["digest"]["hard"] and x["same_as_hard"]["hard_replay"]
        assert x["after"]["hard_replay"] == x["after"]["hard"]
        if nxt is not None:  # hard's probe delta is the baseline's own step change: the next state starts there
            assert nxt["before"] == x["after"]["hard"]
            assert nxt["digest"]["hard"] != x["digest"]["hard"]  # and the weights did move
    assert all(x["metrics"]["hard"]["update_norm"] > 0 for x in lines)


def test_soft_differs_from_hard_exactly_when_something_is_clipped(env, walked):
    lines, _ = walked
    assert all(x["metrics"]["soft"]["clip_frac"] > 0 for x in lines)  # CLIPS: something is clipped at each state
    assert not any(x["same_as_hard"]["soft"] for x in lines)
    for x in lines:  # a rule's update leaves other weights than hard's exactly when it gave clipped tokens a gradient
        assert x["metrics"]["hard"]["dose"] == 0 and x["metrics"]["hard_replay"]["dose"] == 0
        for rule in ("soft", "nsr"):
            assert (x["metrics"][rule]["dose"] > 0) == (not x["same_as_hard"][rule])
    assert any(x["same_as_hard"]["nsr"] for x in lines) and not all(x["same_as_hard"]["nsr"] for x in lines)
    # one minibatch per rollout: every ratio is 1, nothing is clipped, every rule's update is hard's, bit for bit
    on_policy = load_config(PRESET, [f"model.name={env['folder']}", *SMALL, "train.minibatches=1", "train.lr=0.05",
                                     "train.allow_on_policy=true"])  # fmt: skip
    lines1, _ = _walk(env, "onpolicy", on_policy, steps=(1, 3), check_replay=False)
    for x in lines1:
        assert x["metrics"]["soft"]["clip_frac"] == 0 and x["metrics"]["nsr"]["clip_frac"] == 0
        assert x["same_as_hard"] == {"soft": True, "nsr": True}
        assert x["metrics"]["soft"]["dose"] == x["metrics"]["nsr"]["dose"] == 0
        assert x["after"]["soft"] == x["after"]["nsr"] == x["after"]["hard"]


def test_walk_is_deterministic_and_the_gate_reads_it(env, walked):
    lines, out = walked
    again, _ = _walk(env, "again")
    assert [{**x, "wall_s": None} for x in again] == [{**x, "wall_s": None} for x in lines]
    states = stats.load_states(out)
    g = stats.gate(states, "soft", split="held-out")
    assert g["states"] == 3 and g["runs"] == 1
    assert g["mean"] == pytest.approx(sum(x["after"]["soft"] - x["after"]["hard"] for x in lines) / 3)
    assert g["hard_change"] == pytest.approx(sum(x["after"]["hard"] - x["before"] for x in lines) / 3)
    assert stats.load_headers(out)[0]["n_completions"] == len(env["rows"])


def test_the_mechanism_table_names_the_log_prob(walked, capsys):
    _, out = walked
    assert stats.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "probe set's summed log-prob" in text and "pass@1 (" not in text


def test_score_is_the_teacher_forced_log_prob(env):
    import torch

    from experiments.models.smollm2 import load

    pset = probe_set.read_probe_set(env["set"])
    model, _, _ = load(env["folder"])
    total, per_token = probe_set.score(model, pset, 0.7, batch=3)  # padded batches
    assert model.training  # the mode is restored
    sums, means = [], []
    with torch.no_grad():
        model.eval()
        for p, c in zip(pset.prompt_ids, pset.completion_ids):  # one unpadded sequence at a time
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / 0.7
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).sum().item()
            sums.append(lp)
            means.append(lp / len(c))
    assert total == pytest.approx(sum(sums) / len(sums), rel=1e-5)
    assert per_token == pytest.approx(sum(means) / len(means), rel=1e-5)


def test_probe_set_is_held_out_seeded_and_ends_with_eos(env):
    from experiments.rundir import read_jsonl
    from experiments.tasks.arithmetic import write_files

    rows, summary = env["rows"], env["summary"]
    files = write_files(env["cfg"].task)
    train = {r["problem_id"] for r in read_jsonl(files["train"])}
    run_eval = {r["problem_id"] for r in read_jsonl(files["eval"])[: env["cfg"].eval.n_prompts]}
    ids = [r["problem_id"] for r in rows]
    assert summary["problem_ids"] and not (set(summary["problem_ids"]) & (train | run_eval))
    assert all(ids.count(i) <= 2 for i in ids) and len(rows) == summary["kept"] > 0
    for r in rows:  # cut as the rollout cuts: at the first EOS (id 100), else at max_new_tokens
        c = r["completion_ids"]
        assert 100 not in c[:-1] and (c[-1] == 100) == r["eos"] and (r["eos"] or len(c) == 6)
    again, _ = probe_set.make_probe_set(env["cfg"], 2, 6, 4, 2, 0, verify=lambda text, label: True)
    assert again == rows
    other, _ = probe_set.make_probe_set(env["cfg"], 2, 6, 4, 2, 1, verify=lambda text, label: True)
    assert other != rows


def test_refusals_name_the_field(env, tmp_path, capsys):
    cfg = env["cfg"]
    with pytest.raises(ValueError, match="eval.n_prompts=2"):
        probe_set.held_out_rows(cfg, 1, 5)  # row 1 is one of the run's own eval problems
    with pytest.raises(ValueError, match="task.n_eval=100"):
        probe_set.held_out_rows(cfg, 50, 101)
    pset = probe_set.read_probe_set(env["set"])
    with pytest.raises(ValueError, match="weights_sha256"):
        probe_set.check_probe_set(pset, cfg, {"weights_sha256": "0" * 64})
    with pytest.raises(ValueError, match="task key"):
        other = load_config(PRESET, [f"model.name={env['folder']}", *SMALL, *CLIPS, "task.n_train=400"])
        probe_set.check_probe_set(pset, other, None)
    specs = parse_rules("soft", cfg.loss)
    with pytest.raises(ValueError, match="loss.rule='nsr'"):
        nsr_cfg = cfg.replace(loss=cfg.loss.replace(rule="nsr"))
        trl_walk.walk_run(nsr_cfg, tmp_path / "r", specs, [1], pset, tmp_path / "o")
    with pytest.raises(ValueError, match="train.steps=3"):
        trl_walk.walk_run(cfg, tmp_path / "r", specs, [4], pset, tmp_path / "o")
    base = ["--preset", PRESET, f"model.name={env['folder']}", *SMALL]
    assert trl_walk.main(["make-set", *base, "--problems", "0-5", "--out", str(tmp_path / "s.jsonl")]) == 2
    assert "eval.n_prompts" in capsys.readouterr().err
    assert trl_walk.main(["walk", *base, "--probe-set", str(env["set"]), "--out", str(tmp_path / "o")]) == 2
    assert "--run-dir" in capsys.readouterr().err
    # the tiny model answers nothing: make-set with the kit's math reward refuses to write an empty set
    out = tmp_path / "real.jsonl"
    assert trl_walk.main(["make-set", *base, "--problems", "2-3", "--samples", "2", "--out", str(out)]) == 2
    assert "no correct completion" in capsys.readouterr().err and not out.exists()


def test_a_done_walk_is_skipped_and_never_rerun_over(env, walked):
    lines, out = walked
    before = out.read_text()
    specs = parse_rules("soft,nsr", env["cfg"].loss)
    pset = probe_set.read_probe_set(env["set"])
    again = trl_walk.walk_run(env["cfg"], env["root"] / "walk", specs, [1, 2, 3], pset, out)
    assert json.dumps(again) == json.dumps(lines) and out.read_text() == before  # done and complete: skipped, untouched
    with pytest.raises(ValueError, match=r"lacks the states of steps \[1, 2, 3\]"):
        trl_walk.walk_run(env["cfg"], env["root"] / "walk", specs, [1, 2, 3], pset, env["root"] / "other.jsonl")


def test_walk_command_on_a_sweep_writes_the_sweeps_run_folder(env, tmp_path, capsys):
    import yaml

    pairs = (kv.split("=", 1) for kv in [*SMALL, *CLIPS])
    base = {"model.name": env["folder"], **{k: yaml.safe_load(v) for k, v in pairs}}
    sweep = {"name": "probe_test", "preset": "smollm2-trl-cpu", "base": base, "arms": {"hard": {"loss.rule": "hard"}},
             "seeds": [5, 6], "baseline": "hard"}  # fmt: skip
    path = tmp_path / "probe_test.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = str(tmp_path / "gate" / "s{seed}.jsonl")
    args = ["walk", "--sweep", str(path), "--seeds", "6", "--runs-root", str(tmp_path / "runs"), "--start", "2",
            "--states", "1", "--probe-set", str(env["set"]), "--out", out, "--quiet"]  # fmt: skip
    assert trl_walk.main(args) == 0, capsys.readouterr().err
    (folder,) = (tmp_path / "runs" / "probe_test").iterdir()
    assert json.loads((folder / "status.json").read_text())["state"] == "done"
    heads = stats.load_headers(tmp_path / "gate" / "s6.jsonl")
    states = stats.load_states(tmp_path / "gate" / "s6.jsonl")
    assert [s["step"] for s in states] == [2] and states[0]["seed"] == 6
    assert heads[0]["run_id"] == folder.name and "--sweep" in heads[0]["command"]
    assert trl_walk.main([*args[:-3], "--out", str(tmp_path / "no_seed.jsonl")]) == 2  # one file per seed
    assert "{seed}" in capsys.readouterr().err


def test_a_stopped_walk_resumes_from_its_checkpoint(env, walked, monkeypatch):
    lines, _ = walked
    cfg = load_config(PRESET, [f"model.name={env['folder']}", *SMALL, *CLIPS, "logging.checkpoint_every=1"])
    real_finish = trl_walk.Prober.finish

    def crash_at_step_2(self, tr):  # a job killed while it ends step 2: step 1's checkpoint is the last one
        if self.pending["step"] == 2:
            raise RuntimeError("killed")
        real_finish(self, tr)

    monkeypatch.setattr(trl_walk.Prober, "finish", crash_at_step_2)
    with pytest.raises(RuntimeError, match="killed"):
        _walk(env, "stopped", cfg)
    assert [x["step"] for x in stats.load_states(env["root"] / "stopped.jsonl")] == [1]
    monkeypatch.setattr(trl_walk.Prober, "finish", real_finish)
    resumed, out = _walk(env, "stopped", cfg)
    assert stats.load_headers(out)[-1]["resumed_from_step"] == 1
    # the same numbers as the walk that was never stopped (checkpointing changes nothing)
    assert json.dumps([{**x, "wall_s": None} for x in resumed]) == json.dumps([{**x, "wall_s": None} for x in lines])


def test_sigusr1_stops_a_walk_at_the_steps_end_and_the_same_command_resumes(env, walked, monkeypatch, capsys):
    """SIGUSR1 during probed step 2 (no periodic checkpoint: checkpoint_every 0): step 2 ends with its state line and
    a checkpoint, the command exits 143; run again, it resumes from step 2 and gives the never-stopped walk's lines."""
    lines, _ = walked
    real_call = trl_walk.Prober.__call__

    def signal_at_2(self, step, tr):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        real_call(self, step, tr)

    out, run_dir = env["root"] / "usr1.jsonl", env["root"] / "usr1"
    overrides = [f"model.name={env['folder']}", *SMALL, *CLIPS]
    args = ["walk", "--preset", PRESET, *overrides, "--rules", "soft,nsr", "--start", "1", "--states", "3",
            "--probe-set", str(env["set"]), "--run-dir", str(run_dir), "--out", str(out), "--check-replay",
            "--quiet"]  # fmt: skip
    monkeypatch.setattr(trl_walk.Prober, "__call__", signal_at_2)
    assert trl_walk.main(args) == 143
    assert "SIGUSR1" in capsys.readouterr().err
    assert [x["step"] for x in stats.load_states(out)] == [1, 2]
    monkeypatch.setattr(trl_walk.Prober, "__call__", real_call)
    assert trl_walk.main(args) == 0, capsys.readouterr().err
    assert stats.load_headers(out)[-1]["resumed_from_step"] == 2
    resumed = stats.load_states(out)
    strip = [{k: v for k, v in x.items() if k not in ("wall_s", "run")} for x in resumed]
    assert json.dumps(strip) == json.dumps([{k: v for k, v in x.items() if k not in ("wall_s", "run")} for x in lines])
