"""``python -m experiments.trl.precision``: float32 against bfloat16-autocast log-probs on one rollout of the trl
backend's own trainer, on a tiny Qwen2 folder (tests/trl_tiny.py) with the SmolLM2 preset's task and loop, no hub. The
SmolLM2 numbers are in docs/testbed.md, "bfloat16 learner passes: what they do to the ratios"."""

import json

import pytest

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import torch  # noqa: E402
import trl_tiny  # noqa: E402

from experiments.config import ConfigError, load_config  # noqa: E402
from experiments.trl import precision  # noqa: E402

pytestmark = pytest.mark.slow  # make test-fast skips it (TRL trainers)

PRESET = "sweeps/presets/smollm2-trl-cpu.yaml"
# 2 prompts x 4 samples of 6 tokens, 2 minibatches; coin-flip rewards (advantages.kind=random_reward), so a random
# tiny model gets a signal, and lr 0.05, so its ratios reach the clip; rule nsr, so the meter sees rescues
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
         "train.minibatches=2", "eval.n_prompts=2", "advantages.kind=random_reward", "train.lr=0.05",
         "loss.rule=nsr"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    with trl_tiny.one_thread_frozen_gc():
        yield trl_tiny.save_models(tmp_path_factory.mktemp("models"))["dense"]


@pytest.fixture
def task_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))  # the task files go here, not into the repo's cache/
    monkeypatch.setenv("NSR_THREADS", "1")


def _run(tiny_folder, tmp_path, name, capsys, *extra) -> dict:
    out = tmp_path / f"{name}.json"
    args = [PRESET, f"model.name={tiny_folder}", *SMALL, *extra, "--updates", "3", "--json", str(out)]
    assert precision.main(args) == 0
    printed = capsys.readouterr().out
    assert "| step | mean abs(log r bf16 - log r fp32)" in printed and "| 3 | bf16 | neg |" in printed
    return json.loads(out.read_text())


def _numbers(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("command",)}


def test_reports_each_step_and_is_deterministic(tiny_folder, tmp_path, capsys, task_cache):
    a = _run(tiny_folder, tmp_path, "a", capsys)
    assert a["updates"] == 3 and [s["step"] for s in a["steps"]] == [0, 1, 2, 3]
    assert a["threads"] == 1 and len(a["weights_sha256"]) == 64 and len(a["config_hash"]) == 8
    assert a["config"]["loss"]["rule"] == "nsr" and a["trust_region"] == {"eps_low": 0.2, "eps_high": 0.28,
                                                                          "delta": 0.2}  # fmt: skip
    assert a["sequences"] == 8 and 0 < a["tokens_adv"] <= a["tokens"] <= 8 * 6
    # step 0, no update: the same float32 pass on the same weights gives every ratio exactly 1 (bf16 likewise)
    s0 = a["steps"][0]
    for prec in ("fp32", "bf16"):
        assert s0[prec]["max_abs_log_r"] == 0.0 and s0[prec]["clipped_share"] == 0.0
    assert s0["mean_abs_dlog_r"] == 0.0 and s0["clipped_status_differs_share"] == 0.0
    assert s0["mean_abs_dlog_pi"] > 0  # bfloat16 log-probs are not float32's, even before an update
    # after an update: the ratios leave 1, and bfloat16's log r is not float32's
    for s in a["steps"][1:]:
        assert s["fp32"]["max_abs_log_r"] > 0 and s["mean_abs_dlog_r"] > 0 and s["grad_norm"] > 0
        assert s["fp32"]["p50_abs_log_r"] <= s["fp32"]["p99_abs_log_r"] <= s["fp32"]["max_abs_log_r"]
    assert max(s["fp32"]["clipped_share"] for s in a["steps"]) > 0  # lr 0.05 moves ratios past the trust region
    # the premise meter's rows count the same clipped tokens as the command's own clip test, per precision
    for s in a["steps"]:
        for prec in ("fp32", "bf16"):
            row = s[prec]["premise"]
            assert row["tokens"] == a["tokens"] and row["tokens_adv"] == a["tokens_adv"] and row["delta"] == 0.2
            assert len(row["pos_clipped"]) == len(row["neg_clipped"]) == 11
            clipped = sum(row["pos_clipped"]) + sum(row["neg_clipped"])
            assert clipped == round(s[prec]["clipped_share"] * a["tokens"])
    assert a["depth_bin_ratio_edges"]["pos"][0] == pytest.approx(1.28)
    assert a["depth_bin_ratio_edges"]["neg"][0] == pytest.approx(0.8)
    # same config, seed and threads: the same numbers
    b = _run(tiny_folder, tmp_path, "b", capsys)
    assert _numbers(a) == _numbers(b)
    # --table prints the tables of the JSON again, without a model
    assert precision.main(["--table", str(tmp_path / "a.json")]) == 0
    assert capsys.readouterr().out.strip() == precision.tables(a)


def test_passes_are_the_trainers_own(tiny_folder, tmp_path, task_cache):
    """The float32 pass is the trainer's old-log-prob pass (bit for bit, on the rows it computes), and the bfloat16
    pass is what a trl.bf16=true trainer of the same config computes on the same weights and batch (bit for bit),
    with the preset's compact / shared-prompt pass and with TRL's own."""
    from experiments.rundir import RunDir
    from experiments.trl.train import build_trainer

    for speed in ([], ["trl.compact_logprobs=false", "trl.share_prompt=false", "trl.skip_zero_adv=false"]):
        cfg = load_config(PRESET, [f"model.name={tiny_folder}", *SMALL, *speed])

        def at_rollout(tr, kept=(kept := {})):
            kept["batches"] = [dict(b) for b in tr._buffered_inputs]
            raise precision._Measured

        a, _ = build_trainer(cfg, RunDir(tmp_path / "a"), evaluate=False)
        a.after_rollout = at_rollout
        with pytest.raises(precision._Measured):
            a.train()
        ours = []  # before the bf16 trainer is built: accelerate's state is one per process
        for batch in kept["batches"]:
            rows = precision._advantages(batch).ne(0).any(-1) if cfg.trl.skip_zero_adv else slice(None)
            fp32 = precision.completion_logps(a, batch, bf16=False)
            assert torch.equal(fp32[rows], batch["old_per_token_logps"][rows])
            ours.append((fp32, precision.completion_logps(a, batch, bf16=True)))
        cfg_bf16 = load_config(PRESET, [f"model.name={tiny_folder}", *SMALL, *speed, "trl.bf16=true"])
        b, _ = build_trainer(cfg_bf16, RunDir(tmp_path / "b"), evaluate=False)
        assert b.accelerator.mixed_precision == "bf16"
        for batch, (fp32, bf16) in zip(kept["batches"], ours, strict=True):
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                theirs, _, _ = b._get_per_token_logps_and_entropies(b.model, ids, mask, batch["completion_ids"].size(1))
            assert torch.equal(bf16, theirs.float())
            valid = precision._valid(batch)
            assert not torch.equal(bf16[valid], fp32[valid])


@pytest.mark.parametrize(
    "overrides, updates, field",
    [
        (["trl.bf16=true"], 3, "trl.bf16=True"),
        (["loss.level=sequence"], 3, "loss.level='sequence'"),
        ([], 0, "--updates=0"),
        ([], -1, "--updates=-1"),
    ],
)
def test_refusals_before_any_model_work(tiny_folder, overrides, updates, field, monkeypatch):
    def no_model(*a, **kw):
        raise AssertionError("a trainer was built")

    monkeypatch.setattr("experiments.trl.train.build_trainer", no_model)
    args = [PRESET, f"model.name={tiny_folder}", *SMALL, *overrides, "--updates", str(updates)]
    with pytest.raises(ConfigError, match=f"{field.replace('(', '[(]')} is not valid.*allowed: "):
        precision.main(args)


def test_refuses_a_backend_other_than_trl(monkeypatch):
    monkeypatch.setattr("experiments.trl.train.build_trainer", lambda *a, **kw: pytest.fail("a trainer was built"))
    with pytest.raises(ConfigError, match="backend='tiny' is not valid for experiments.trl.precision; allowed: trl"):
        precision.main(["sweeps/presets/tiny-smoke.yaml", "--updates", "3"])


def test_the_docs_tables_are_the_committed_measurements():
    """docs/testbed.md shows the tables of every committed SmolLM2 measurement, as --table prints them."""
    from experiments.rundir import REPO_ROOT

    files = sorted((REPO_ROOT / "results/smollm2").glob("precision-*.json"))
    assert files
    page = (REPO_ROOT / "docs/testbed.md").read_text()
    for path in files:
        data = json.loads(path.read_text())
        assert data["config"]["trl"]["bf16"] is False and not data["git_dirty"]
        assert precision.tables(data).split("\n", 2)[2] in page, path.name
        assert path.relative_to(REPO_ROOT).as_posix() in page
