"""python -m analysis.premise: counts, reach, in-zone clipped mass per token and the zone's edges from real run folders
(the committed tiny grid and stage R0's runs), and from logs each framework's own logger wrote: a TRL trainer_state.json
(TRL's Trainer), OpenRLHF's TensorBoard events (its TensorboardLogger), verl 0.9.1's file logger; bad inputs. The trl
backend's folder is read in tests/test_trl.py (its module's runs)."""

import json

import numpy as np
import pytest
import torch
from conftest import make_batch

import nsr
from analysis import premise
from analysis.regime import reach_share
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl
from nsr.premise import N_BINS, premise_counts, token_ratio

DELTA = REPO_ROOT / "results" / "runs" / "delta"


def _committed(prefix: str) -> RunDir:
    found = sorted(p for p in DELTA.glob(f"{prefix}-s0-*") if (p / "ratio_bins.jsonl.gz").exists())
    assert found, f"no committed run {prefix}-s0-* under {DELTA}"
    return RunDir(found[0])


@pytest.mark.parametrize("prefix", ["hard", "nsr-delta0.2"])
def test_committed_tiny_runs_read_as_the_regime_readout_reads_them(prefix):
    """Reach equals analysis/regime.py's reach share of the same histogram; the in-zone mass per token is the side's
    mean clip fraction (metrics.jsonl) times that reach."""
    rd = _committed(prefix)
    got = premise.read_run(rd.path)
    bins, metrics = read_jsonl(rd.log_path("ratio_bins.jsonl")), read_jsonl(rd.metrics_path)
    cfg = rd.read_config()
    assert (got["backend"], got["rule"], got["delta"], got["steps"]) == (
        "tiny", cfg["loss"]["rule"], cfg["loss"]["delta"], len(bins)
    )  # fmt: skip
    for side, frac in (("pos", "clip_frac_high"), ("neg", "clip_frac_low")):
        hist = np.sum([r[f"{side}_clipped"] for r in bins], axis=0)
        assert got[f"{side}_reach"] == reach_share(hist)
        assert got[f"{side}_clipped"] == hist.sum() > 0
        clip = np.mean([r[frac] for r in metrics])
        assert got[f"{side}_clipped_per_token"] == pytest.approx(clip, rel=1e-12)
        assert got[f"{side}_zone_per_token"] == pytest.approx(clip * reach_share(hist), rel=1e-12)
        assert 0 < got[f"{side}_zone_per_token"] < got[f"{side}_clipped_per_token"]


R0 = REPO_ROOT / "results" / "runs" / "regime_r0"
EPS = ["--eps-low", "0.2", "--eps-high", "0.28", "--delta", "0.2"]


def _sides(out: str) -> dict[str, list[str]]:
    """The two side rows of the first table in ``out``: {"A>0": cells, "A<0": cells}."""
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith(("| A>0", "| A<0"))]
    return {r[0]: r[1:] for r in rows[:2]}


def test_committed_r0_run_prints_counts_rates_edges_and_the_reading(capsys):
    """A committed stage R0 run (no token counts in its rows): counts per side from its ratio_bins, both per-token
    rates at 3 significant figures (stage R0's estimate, and the one over tokens with A != 0 from mixed_group_frac,
    each labelled), the zone's edges at eps 0.2 / 0.28 and delta 0.2 (1.28 .. 1.6, 0.667 .. 0.8), the combined mass
    and the reading against stage R0's thresholds; --json the same numbers."""
    (run,) = R0.glob("hard-s11-*")
    rd = RunDir(run)
    bins, metrics = read_jsonl(rd.log_path("ratio_bins.jsonl")), read_jsonl(rd.metrics_path)
    assert premise.main([str(run)]) == 0
    out = capsys.readouterr().out
    sides = _sides(out)
    mixed = np.mean([r["mixed_group_frac"] for r in metrics])
    combined = 0.0
    for side, name, frac, edges in (("pos", "A>0", "clip_frac_high", "1.28 .. 1.6"),
                                    ("neg", "A<0", "clip_frac_low", "0.667 .. 0.8")):  # fmt: skip
        hist = np.sum([r[f"{side}_clipped"] for r in bins], axis=0)
        share = reach_share(hist)
        per_token = np.mean([r[frac] for r in metrics]) * share
        combined += per_token
        assert sides[name] == [str(hist.sum()), str(hist[:N_BINS].sum()), f"{share:.3g}", edges, f"{per_token:.3g}",
                               f"{per_token / mixed:.3g}"]  # fmt: skip
    assert "per token: estimate: mean clip fraction x reach" in out and "approximation: per token / mean" in out
    assert f"in-zone clipped per token, both sides: {combined:.3g}" in out
    (reading,) = [x for x in out.splitlines() if x.startswith("reading: ")]
    assert f"in-zone clipped {combined:.3g} per token against 0.002" in reading and "against 0.5" in reading
    assert "little near-boundary signal" in reading and "analysis/regime.yaml stage_r0" in out
    assert premise.main([str(run), "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    assert got["pos_zone_edges"] == pytest.approx([1.28, 1.6]) and got["neg_zone_edges"] == pytest.approx(
        [0.8 / 1.2, 0.8]
    )
    assert got["zone_per_token"] == pytest.approx(combined, rel=1e-12) and got["reading"] in reading


def _check_counts(got: dict, counts: torch.Tensor, tokens: float, tokens_adv: float) -> None:
    """A reading against the premise meter's own summed counts and token totals: exact counts, reach and rates."""
    assert got["tokens"] == pytest.approx(tokens) and got["tokens_adv"] == pytest.approx(tokens_adv)
    for i, side in enumerate(("pos", "neg")):
        zone, deep = counts[i, 0, :N_BINS].sum().item(), counts[i, 0, N_BINS].item()
        assert zone > 0 and deep > 0, side  # the batches clip on both sides, in the zone and deeper
        assert (got[f"{side}_clipped"], got[f"{side}_zone"]) == (round(zone + deep), round(zone))
        assert got[f"{side}_reach"] == pytest.approx(zone / (zone + deep), rel=1e-9)
        assert got[f"{side}_zone_per_token"] == pytest.approx(zone / tokens, rel=1e-6)
        assert got[f"{side}_zone_per_adv_token"] == pytest.approx(zone / tokens_adv, rel=1e-6)


def test_openrlhf_tensorboard_written_by_openrlhfs_logger(tmp_path, capsys):
    """The launcher's premise scalars of real NSRPolicyLoss meters (two RL steps, a fresh meter per step as the actor
    resets it), written by OpenRLHF 0.11.2's own TensorboardLogger: the reading's counts, token totals and rates are
    the meters' own."""
    from types import SimpleNamespace

    from test_openrlhf_metrics import _tb_logger_cls

    from nsr.openrlhf.loss import NSRPolicyLoss
    from nsr.openrlhf.metrics import premise_logs
    from nsr.openrlhf.settings import NSRSettings

    tb = _tb_logger_cls()(SimpleNamespace(logger=SimpleNamespace(tensorboard_dir=str(tmp_path),
                                                                  wandb=SimpleNamespace(run_name="r"))))  # fmt: skip
    fn = NSRPolicyLoss(0.2, 0.28, None, settings=NSRSettings.make(rule="nsr", delta=0.2), seed=0, rank=0)
    total, tokens, tokens_adv = torch.zeros(2, 3, N_BINS + 1, dtype=torch.float64), 0.0, 0.0
    for step in (1, 2):
        fn.start_step(step)
        logp, old, adv, mask = make_batch(B=8, T=16, seed=step, spread=0.6)
        adv[0] = 0.0  # a response whose group tied: no advantage
        fn(logp.clone().requires_grad_(), old, adv[:, :1].expand_as(logp) * mask, action_mask=mask.long())
        meter = fn.premise  # what the actor sends (nsr.openrlhf.actors.premise_status, one rank: no all-reduce)
        total += meter.counts()
        tokens, tokens_adv = tokens + meter.tokens.item(), tokens_adv + meter.tokens_adv.item()
        logs = premise_logs(meter.counts().tolist(), meter.tokens.item(), meter.tokens_adv.item())
        tb.log_train(step, {"policy_loss": 0.1, **logs})
        meter.reset()
    tb.close()
    assert tokens_adv < tokens
    got = premise.read(tmp_path, (0.2, 0.28), 0.2)
    assert (got["kind"], got["steps"], got["pos_zone_edges"]) == ("OpenRLHF TensorBoard", 2, pytest.approx([1.28, 1.6]))
    _check_counts(got, total, tokens, tokens_adv)
    assert premise.main([str(tmp_path), *EPS]) == 0
    sides = _sides(capsys.readouterr().out)
    assert sides["A>0"][:2] == [str(got["pos_clipped"]), str(got["pos_zone"])] and sides["A>0"][3] == "1.28 .. 1.6"


@pytest.mark.slow
def test_trl_trainer_state_written_by_trls_trainer(tmp_path, capsys):
    """NSRGRPOTrainer, 2 steps of a tiny policy with 2 iterations per generation, checkpointing: the trainer_state.json
    TRL's Trainer wrote reads to the counts and token totals of the trainer's own premise meter windows."""
    import trl_tiny
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from nsr.trl import NSRGRPOTrainer

    seen = []

    class Windows(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if trainer.premise_counts is not None and "premise/tokens" in (logs or {}):
                seen.append((trainer.premise_counts.clone(), *trainer.premise_tokens))
                trainer.premise_counts = None

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", num_iterations=2, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8, max_steps=4, logging_steps=1, save_strategy="steps", save_steps=4,
        disable_tqdm=True, seed=0, temperature=1.5, learning_rate=0.05, epsilon=0.2, epsilon_high=0.28,
    )  # fmt: skip
    trainer = NSRGRPOTrainer(
        model=trl_tiny.dense_lm(), args=args, train_dataset=trl_tiny.zen()["train"],
        reward_funcs=lambda completions, **kw: [float(len(c) % 3 == 0) for c in completions],
        processing_class=trl_tiny.char_tokenizer(), loss=nsr.LossConfig(rule="nsr"), callbacks=[Windows()],
    )  # fmt: skip
    trainer.train()
    state = tmp_path / "checkpoint-4" / "trainer_state.json"
    assert state.is_file() and len(seen) == 4
    total = sum(c for c, _, _ in seen)
    got = premise.read(state.parent, (0.2, 0.28), 0.2)
    assert (got["kind"], got["steps"]) == ("TRL trainer_state.json", 4)
    assert got["tokens"] == sum(t for _, t, _ in seen) and got["tokens_adv"] == sum(a for _, _, a in seen)
    for i, side in enumerate(("pos", "neg")):
        zone, deep = total[i, 0, :N_BINS].sum().item(), total[i, 0, N_BINS].item()
        assert (got[f"{side}_clipped"], got[f"{side}_zone"]) == (round(zone + deep), round(zone))
        assert got[f"{side}_zone_per_token"] == pytest.approx(zone / got["tokens"], rel=1e-6, abs=1e-12)
    assert got["pos_clipped"] + got["neg_clipped"] > 0
    assert premise.main([str(state), *EPS]) == 0 and "reading: " in capsys.readouterr().out


def _verl_step_metrics(step: int) -> dict:
    """One training step as verl 0.9.1 reduces it: the nsr:nsr loss function on two micro-batches, each metric dict
    wrapped as verl's workers/utils/losses.py wraps it (Metric, mean), joined over the micro-batches and reduced by
    verl's reduce_metrics."""
    from verl.trainer.ppo import core_algos
    from verl.utils.metric import AggregationType, Metric, reduce_metrics
    from verl.workers.config import ActorConfig

    import nsr.verl

    pl = nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:nsr", delta=0.2, seed=0)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                        clip_ratio_high=0.28, policy_loss=pl)  # fmt: skip
    joined: dict = {}
    for micro in range(2):
        logp, old, adv, mask = make_batch(B=8, T=16, seed=10 * step + micro, spread=0.6)
        _, met = core_algos.get_policy_loss_fn("nsr:nsr")(
            old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
            config=actor,
        )  # fmt: skip
        for k, m in Metric.from_dict(met, aggregation=AggregationType.MEAN).items():
            joined.setdefault(k, m.init_list()).extend(m)
    return reduce_metrics(joined)


def test_verl_log_written_by_verls_own_file_logger(tmp_path, monkeypatch):
    pytest.importorskip("verl")
    from verl.utils.tracking import FileLogger

    log = tmp_path / "verl.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(log))
    fl = FileLogger("nsr", "premise")
    steps = {s: _verl_step_metrics(s) for s in (1, 2, 3)}
    for s, data in steps.items():
        fl.log({**data, "critic/score/mean": 0.5}, step=s)
    fl.log({"val-core/acc": 0.3}, step=4)  # a validation-only step: no premise metrics
    fl.finish()
    got = premise.read_verl(log, (0.2, 0.28), 0.2)
    assert got["backend"] == "verl" and got["steps"] == 3
    for side in ("pos", "neg"):  # the logged mean counts pooled: sum of step means over sum of mean tokens
        zone = sum(steps[s][f"actor/premise/n_{side}_clipped_zone"] for s in steps)
        deep = sum(steps[s][f"actor/premise/n_{side}_clipped_deep"] for s in steps)
        tokens = sum(steps[s]["actor/premise/n_tokens"] for s in steps)
        assert zone > 0 and deep > 0  # the batches clip on both sides, in the zone and deeper
        assert got[f"{side}_reach"] == pytest.approx(zone / (zone + deep), rel=1e-12)
        assert got[f"{side}_zone_per_token"] == pytest.approx(zone / tokens, rel=1e-12)
        assert (got[f"{side}_clipped"], got[f"{side}_zone"]) == (round(zone + deep), round(zone))

    # each logged rate is the mean over the step's micro-batches of that micro-batch's rate (clipped counts do not
    # depend on the rule's draws: the hard clip's test)
    cfg = nsr.LossConfig(rule="nsr", delta=0.2)
    per_micro = []
    for micro in range(2):
        logp, old, adv, mask = make_batch(B=8, T=16, seed=10 + micro, spread=0.6)
        c = premise_counts(torch.ones_like(logp), token_ratio(logp, old), adv, mask, cfg)
        per_micro.append(c[0, 0, :N_BINS].sum().item() / mask.sum().item())
    assert steps[1]["actor/premise/pos_clipped_zone"] == pytest.approx(np.mean(per_micro), rel=1e-12)
    assert premise.main(["--verl", str(log), *EPS]) == 0
    assert premise.main([str(log)]) == 2  # a framework log without the trust region


def test_bad_inputs_are_refused_before_anything_is_printed(tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    seq = tmp_path / "seq"
    seq.mkdir()
    (seq / "config.yaml").write_text("backend: tiny\nloss: {rule: nsr, level: sequence}\n")
    log = tmp_path / "plain.jsonl"
    log.write_text(json.dumps({"step": 1, "data": {"actor/pg_clipfrac": 0.1}}) + "\n")
    hard = str(_committed("hard").path)
    for argv, msg in (
        ([hard, str(tmp_path / "nope")], "no such run folder"),
        ([hard, str(empty)], "not a run folder (no config.yaml)"),
        ([str(seq)], "no ratio_bins.jsonl; the premise meter is written at token level"),
        (["--verl", str(log), *EPS], "no step logged the actor/premise/* metrics"),
        (["--verl", str(tmp_path / "none.jsonl"), *EPS], "no such verl metrics log"),
        ([str(log)], "a verl log holds no trust region; give the run's --eps-low, --eps-high and --delta"),
    ):
        assert premise.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and msg in err, (argv, err)
    with pytest.raises(SystemExit):
        premise.main([])
