"""experiments.mechanism: the exact expected pass@1 is what sampling estimates, the paired updates start from the
baseline's exact state (a direct rl_step loop gives the same numbers), identical rules give zero differences, and
the test is deterministic. Tiny setting (4 prompts x 8 samples, a 120-step warm start): about 30 s on one core."""

from __future__ import annotations

import math

import pytest
import torch

from analysis import mechanism as A
from experiments.config import load_config
from experiments.mechanism import toy as M
from experiments.models.tiny import build_model, generate
from experiments.sft import warm_start
from experiments.tasks.countdown import get_task
from experiments.tiny.train import rl_step
from nsr.seeds import generator

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

OVERRIDES = [
    "sft.steps=120",  # a short warm start of its own (in a temporary cache): accuracy about 1%, enough to score
    "sft.warmup=20",
    "rollout.prompts_per_step=4",
    "train.steps=6",
    "eval.n_prompts=64",
]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("NSR_CACHE_DIR", str(tmp_path_factory.mktemp("nsr-cache")))
    mp.setenv("NSR_THREADS", "1")
    threads = torch.get_num_threads()
    yield load_config("sweeps/presets/tiny-smoke.yaml", OVERRIDES)
    mp.undo()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy(cfg):
    state, _ = warm_start(cfg)
    model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
    model.load_state_dict(state)
    return model


def test_exact_pass1_is_what_sampling_estimates(cfg, policy):
    """Enumerated answers scored by teacher forcing vs the eval's own sampler and verifier (64 samples each)."""
    task = get_task("countdown3")
    ids = task.eval_ids[:96]
    exact = M.expected_pass1(policy, M.answer_set(task, ids))
    k = 64
    prompts = task.prompts(ids).repeat_interleave(k, 0)
    comps = generate(policy, prompts, cfg.rollout.max_new_tokens, 1.0, generator(7, "mc"))
    mc = task.rewards(ids.repeat_interleave(k), comps).mean().item()
    se = math.sqrt(max(exact * (1 - exact), 1e-4) / len(prompts))
    assert 0.005 < exact < 0.9
    assert abs(mc - exact) < 4 * se
    assert M.expected_pass1(policy, M.answer_set(task, ids), dtype=torch.float32) == pytest.approx(exact, abs=1e-5)


def test_paired_updates_start_from_the_baseline_state(cfg):
    """The hard arm at every state equals a plain rl_step loop of the baseline (optimizer state carried over)."""
    specs = M.parse_rules("widen:by=0.5", cfg.loss)
    res = M.run_test(cfg, specs, n_states=3, runs=1, start=1, every=1, train_split=False)
    task = get_task("countdown3")
    held = M.answer_set(task, task.eval_ids)
    state, _ = warm_start(cfg)
    model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
    model.load_state_dict(state)
    tr = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tr.adam_betas, weight_decay=tr.weight_decay)
    for step, r in zip((1, 2, 3), res):
        assert r.step == step
        assert r.before == M.expected_pass1(model, held)
        rl_step(model, opt, task, cfg, step)
        assert r.after["hard"] == M.expected_pass1(model, held)
    # widening by 0.5 keeps tokens hard drops, so its update differs: the test is not vacuous
    assert any(r.after["widen:by=0.5"] != r.after["hard"] for r in res)


def test_identical_rules_give_zero_and_reruns_are_identical(cfg):
    specs = M.parse_rules("widen:by=0,nsr", cfg.loss)
    a = M.run_test(cfg, specs, n_states=2, runs=2, start=2, every=1, train_split=True)
    b = M.run_test(cfg, specs, n_states=2, runs=2, start=2, every=1, train_split=True)
    assert [x.__dict__ for x in a] == [x.__dict__ for x in b]
    assert [(x.run, x.step) for x in a] == [(0, 2), (1, 2)]
    rows = {r["rule"]: r for r in A.summarize([x.__dict__ for x in a], [s.label for s in specs])}
    assert rows["widen:by=0"]["diff"] == 0.0 and rows["hard"]["diff"] == 0.0
    assert math.isfinite(rows["nsr"]["diff"]) and rows["nsr"]["states"] == 2


def test_rule_specs_and_bad_input(cfg, capsys, tmp_path):
    specs = M.parse_rules("nsr, soft:delta=0.1, widen, noisy_decision:ratio_noise=0.3", cfg.loss)
    by = {s.label: s.loss for s in specs}
    assert list(by)[0] == "hard" and by["hard"] == cfg.loss.replace(rule="hard")
    assert by["soft:delta=0.1"].delta == 0.1 and by["noisy_decision:ratio_noise=0.3"].ratio_noise == 0.3
    assert by["widen"].eps_low == pytest.approx(cfg.loss.eps_low + cfg.loss.delta)
    with pytest.raises(ValueError, match=r"unknown rule 'bogus'; allowed: widen, hard, nsr"):
        M.parse_rules("bogus", cfg.loss)
    with pytest.raises(ValueError, match=r"'by' is not valid|allowed: key=value with key in \['by'\]"):
        M.parse_rules("widen:delta=0.1", cfg.loss)
    with pytest.raises(ValueError, match=r"needs step 12; allowed: at most train.steps = 6"):
        M.state_steps(3, 1, 2, 5, 6)
    out = ["--out", str(tmp_path / "m.jsonl")]
    assert M.main(["--preset", "sweeps/presets/tiny-smoke.yaml", "--rules", "nsr,bogus", *out, *OVERRIDES]) == 2
    assert "unknown rule 'bogus'" in capsys.readouterr().err
    assert M.main(["--preset", "sweeps/presets/tiny-smoke.yaml", "--states", "0", *out, *OVERRIDES]) == 2
    assert "--states=0 is not valid" in capsys.readouterr().err
    assert M.main(["--preset", "sweeps/presets/tiny-smoke.yaml", "--seeds", "3-1", *out, *OVERRIDES]) == 2
    assert "--seeds '3-1' is not valid" in capsys.readouterr().err
    assert M.main(["--preset", "sweeps/presets/tiny-smoke.yaml", "task.name=add3", *out, *OVERRIDES]) == 2
    assert "whose answers can be enumerated (countdown3, countdown4)" in capsys.readouterr().err
    (tmp_path / "m.jsonl").write_text('{"run": 0}\n')
    assert M.main(["--preset", "sweeps/presets/tiny-smoke.yaml", "--states", "2", *out, *OVERRIDES]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert M.parse_seeds("201-203,7") == [201, 202, 203, 7]


def test_own_warm_start_per_run_and_the_gate(cfg, tmp_path, capsys):
    """--seeds with --tie-sft-seed: each baseline run starts from its own warm start; the CLI writes the states and
    analysis.mechanism's gate reads them (soft - hard on the training split, over run means)."""
    out = tmp_path / "gate.jsonl"
    args = [
        "--preset",
        "sweeps/presets/tiny-smoke.yaml",
        "--rules",
        "soft",
        "--seeds",
        "5-6",
        "--tie-sft-seed",
        "--states",
        "2",
        "--start",
        "2",
        "--every",
        "2",
        "--no-held-out",
        "--out",
        str(out),
        "--quiet",
        *OVERRIDES,
    ]
    assert M.main(args) == 0
    states = A.load_states(out)
    assert [(s["seed"], s["sft_seed"], s["step"]) for s in states] == [(5, 5, 2), (6, 6, 2)]
    assert all(math.isnan(s["before"]) and 0 < s["train_before"] < 1 for s in states)
    assert states[0]["train_before"] != states[1]["train_before"]  # two warm starts (seed 5 and 6), not one
    g = A.gate(states, "soft")
    diffs = [s["train_after"]["soft"] - s["train_after"]["hard"] for s in states]
    assert g["runs"] == 2 and g["run_means"] == pytest.approx(diffs) and g["mean"] == pytest.approx(sum(diffs) / 2)
    assert g["lower"] < g["mean"] and 0 <= g["p"] <= 1
    assert all(s["metrics"]["hard"]["dose"] == 0 for s in states) and g["dose"] >= 0  # hard gives clipped tokens none
    fam = A.gate_family({"a": g, "b": None, "c": {**g, "p": 0.001}})
    assert fam["b"]["passes"] is False and fam["b"]["p_holm"] == 1.0
    assert fam["c"]["p_holm"] == pytest.approx(0.003) and fam["c"]["passes"]
    assert A.main([str(out), "--gate", "soft"]) == 0 and '"runs": 2' in capsys.readouterr().out
