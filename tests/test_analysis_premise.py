"""python -m analysis.premise: reach and in-zone clipped mass per token from real run folders (the committed tiny
grid, run folders made here by the tiny backend) and from a log written by verl 0.9.1's own file logger with the
plug-in's metrics; bad inputs. The trl backend's folder is read in tests/test_trl.py (its module's runs)."""

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


def test_cli_prints_one_row_per_input_and_the_legend(capsys):
    hard, nsr_run = _committed("hard"), _committed("nsr-delta0.2")
    assert premise.main([str(hard.path), str(nsr_run.path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "source" not in line]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == [str(hard.path), str(nsr_run.path)]
    reading = premise.read_run(hard.path)
    assert f"| {reading['pos_reach']:.4f} | {reading['neg_reach']:.4f} |" in rows[0]
    assert "reach: share of the clipped tokens within NSR's rescue zone" in out


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
    got = premise.read_verl(log)
    assert got["backend"] == "verl" and got["steps"] == 3
    for side in ("pos", "neg"):
        zone = np.mean([steps[s][f"actor/premise/{side}_clipped_zone"] for s in steps])
        deep = np.mean([steps[s][f"actor/premise/{side}_clipped_deep"] for s in steps])
        assert zone > 0 and deep > 0  # the batches clip on both sides, in the zone and deeper
        assert got[f"{side}_reach"] == pytest.approx(zone / (zone + deep), rel=1e-12)
        assert got[f"{side}_zone_per_token"] == pytest.approx(zone, rel=1e-12)
    # each logged rate is the mean over the step's micro-batches of that micro-batch's rate (clipped counts do not
    # depend on the rule's draws: the hard clip's test)
    cfg = nsr.LossConfig(rule="nsr", delta=0.2)
    per_micro = []
    for micro in range(2):
        logp, old, adv, mask = make_batch(B=8, T=16, seed=10 + micro, spread=0.6)
        c = premise_counts(torch.ones_like(logp), token_ratio(logp, old), adv, mask, cfg)
        per_micro.append(c[0, 0, :N_BINS].sum().item() / mask.sum().item())
    assert steps[1]["actor/premise/pos_clipped_zone"] == pytest.approx(np.mean(per_micro), rel=1e-12)
    assert premise.main(["--verl", str(log)]) == 0


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
        (["--verl", str(log)], "no step logged the actor/premise/* metrics"),
        (["--verl", str(tmp_path / "none.jsonl")], "no such verl metrics log"),
    ):
        assert premise.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and msg in err, (argv, err)
    with pytest.raises(SystemExit):
        premise.main([])
