"""nsr.verl against verl 0.9.1's real code on CPU: our rules as verl loss modes, equal to verl's vanilla where the
formulas agree, configured through verl's own structured configs and hydra recipe composition."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by `make venv` (pip install --no-deps verl==0.9.1)")

from conftest import make_batch  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import nsr  # noqa: E402
import nsr.verl  # noqa: E402
from nsr.premise import RATE_KEYS  # noqa: E402
from nsr.verl.plugin import PREMISE_COUNT_KEYS as COUNT_KEYS  # noqa: E402

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Every aggregation mode of verl's agg_loss: the plug-in reduces with verl's own agg_loss, so all are shared."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def actor(loss_mode: str, policy_loss=None, **kw) -> ActorConfig:
    """verl's actor config with a DAPO trust region (0.2 / 0.28) and verl's default dual clip (3.0)."""
    pl = policy_loss or nsr.verl.NSRPolicyLossConfig(loss_mode=loss_mode)
    args = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.28)
    return ActorConfig(**(args | kw), policy_loss=pl)


def dual_batch(seed=0):
    """A padded batch with ratios up to ~e^2: some tokens with A < 0 pass verl's dual-clip bound 3.0."""
    logp, old, adv, mask = make_batch(B=16, T=24, seed=seed, spread=0.8)
    return logp, old, adv.clone(), mask


def run(mode: str, cfg: ActorConfig, batch, agg="token-mean", **kw):
    logp, old, adv, mask = batch
    lp = logp.detach().clone().requires_grad_()
    fn = core_algos.get_policy_loss_fn(mode)  # found through verl's own lookup
    loss, met = fn(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg, **kw
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, {k: float(v) for k, v in met.items()}


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("ours", [("nsr:hard", {}), ("nsr:nsr", {"delta": 0.0}), ("nsr:soft", {"delta": 0.0})])
def test_hard_with_dual_clip_equals_verl_vanilla(agg, ours):
    """hard (and nsr / soft at delta 0) with dual_clip = clip_ratio_c: verl's vanilla in loss, gradient and the
    three metrics verl logs (clip fraction, ppo_kl, dual-clip fraction)."""
    mode, extra = ours
    batch = dual_batch()
    ref = run("vanilla", actor("vanilla", PolicyLossConfig()), batch, agg)
    got = run(mode, actor(mode, nsr.verl.NSRPolicyLossConfig(loss_mode=mode, **extra)), batch, agg)
    assert ref[2]["actor/pg_clipfrac"] > 0.05 and ref[2]["actor/pg_clipfrac_lower"] > 0.01  # both clips fire
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    assert got[2]["actor/ppo_kl"] == pytest.approx(ref[2]["actor/ppo_kl"], rel=1e-12, abs=1e-12)
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):  # verl averages a float32 mask: same count
        assert got[2][key] == pytest.approx(ref[2][key], rel=1e-6), key


def test_rollout_correction_weights_as_vanilla():
    batch = dual_batch(seed=1)
    w = torch.rand(batch[0].shape, generator=torch.Generator().manual_seed(3), dtype=batch[0].dtype) + 0.5
    ref = run("vanilla", actor("vanilla", PolicyLossConfig()), batch, rollout_is_weights=w)
    got = run("nsr:hard", actor("nsr:hard"), batch, rollout_is_weights=w)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)


def test_nsr_rescues_and_reports_its_metrics():
    nsr.verl.plugin._GENERATORS.clear()  # fresh streams: another test in this process may have drawn from seed 0's
    batch = dual_batch(seed=2)
    pl = nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:nsr", delta=0.2, seed=0)
    loss, grad, met = run("nsr:nsr", actor("nsr:nsr", pl), batch)
    hard_loss, hard_grad, hard_met = run("nsr:hard", actor("nsr:hard"), batch)
    assert met["actor/nsr_rescue_frac"] > 0 and hard_met["actor/nsr_rescue_frac"] == 0
    assert met["actor/pg_clipfrac"] == met["actor/nsr_clip_frac"] == hard_met["actor/pg_clipfrac"]
    assert not torch.equal(grad, hard_grad)  # rescued tokens get a gradient
    assert set(met) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} | {
        f"actor/nsr_{k}" for k in nsr.METRIC_KEYS
    } | {f"actor/premise/{k}" for k in RATE_KEYS} | {f"actor/premise/n_{k}" for k in COUNT_KEYS}
    t = float(met["actor/premise/n_tokens"])
    assert t == batch[3].sum().item() and float(met["actor/premise/n_tokens_adv"]) <= t
    for k in ("pos_clipped_zone", "neg_clipped_deep"):  # the counts are the rates' numerators
        assert float(met[f"actor/premise/n_{k}"]) == pytest.approx(float(met[f"actor/premise/{k}"]) * t, rel=1e-12)
    again = run("nsr:nsr", actor("nsr:nsr", nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:nsr", seed=7)), batch)
    assert not torch.equal(again[1], grad)  # another seed, other draws
    nsr.verl.plugin._GENERATORS.clear()
    assert torch.equal(run("nsr:nsr", actor("nsr:nsr", pl), batch)[1], grad)  # same seed, same draws


def test_parameters_come_from_verl_keys():
    a = actor("nsr:nsr", clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=4.0, tau_pos=2.0, tau_neg=3.0)
    cfg = nsr.verl.loss_config("nsr", a)
    assert (cfg.eps_low, cfg.eps_high, cfg.dual_clip, cfg.sapo_tau_pos, cfg.sapo_tau_neg) == (0.1, 0.3, 4.0, 2.0, 3.0)
    off = actor("nsr:nsr", nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:nsr", dual_clip=False, executor="clean"))
    assert nsr.verl.loss_config("nsr", off).dual_clip is None and nsr.verl.loss_config("nsr", off).executor == "clean"
    plain = actor("nsr:nsr", PolicyLossConfig(loss_mode="nsr:nsr"))  # verl's own config: our defaults
    assert nsr.verl.loss_config("nsr", plain).delta == 0.2


def test_bad_values_name_the_verl_key():
    with pytest.raises(ValueError, match=r"policy_loss\.loss_mode='nsr:nope' is not valid; allowed: hard, nsr"):
        nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:nope")
    with pytest.raises(ValueError, match=r"policy_loss\.delta=1\.5 is not valid"):
        nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:nsr", delta=1.5)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.clip_ratio_low=1\.2 is not valid"):
        nsr.verl.loss_config("hard", actor("nsr:hard", clip_ratio_low=1.2))


def test_recipe_composition_with_the_two_lines():
    """verl's own trainer config composed by hydra with docs/plugins.md's two lines (+ an optional parameter), turned
    into dataclasses as verl's actor worker does (engine_workers: omega_conf_to_dataclass(config.actor))."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    recipe = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # every recipe sets a micro-batch size
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        overrides = [*recipe, *README_LINES, "+actor_rollout_ref.actor.policy_loss.delta=0.1"]
        cfg = compose("ppo_trainer", overrides=overrides)
    a = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(a.policy_loss) is nsr.verl.NSRPolicyLossConfig
    assert (a.policy_loss.loss_mode, a.policy_loss.delta) == ("nsr:nsr", 0.1)
    plain = {**cfg.actor_rollout_ref.actor.policy_loss, "_target_": "verl.workers.config.PolicyLossConfig"}
    with pytest.raises(Exception, match="delta"):  # verl's plain config refuses our keys: hence the subclass
        omega_conf_to_dataclass(plain)


README_LINES = (
    "actor_rollout_ref.actor.policy_loss._target_=nsr.verl.NSRPolicyLossConfig",
    "actor_rollout_ref.actor.policy_loss.loss_mode=nsr:nsr",
)


def _validated(*overrides):
    """verl's own validate_config (what main_ppo runs before any worker) on verl's trainer config with the two lines,
    a one-GPU recipe of 8 prompts per step and ``overrides``."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import validate_config

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "data.train_batch_size=8"]  # fmt: skip
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[*base, *README_LINES, *overrides])
    validate_config(cfg, use_reference_policy=False, use_critic=False)


def test_one_update_per_step_is_refused_by_verls_validation():
    """ppo_epochs 1 with the whole step's batch in one mini-batch: every ratio is 1, so nsr:nsr is refused by verl's
    own validate_config, naming the fields; a stale update (2 mini-batches, or 2 epochs), nsr:hard, old log-probs from
    the rollout engine or allow_on_policy pass."""
    mini = "actor_rollout_ref.actor.ppo_mini_batch_size"
    with pytest.raises(ValueError, match=r"ppo_epochs=1 with actor_rollout_ref\.actor\.ppo_mini_batch_size=8 and "
                                         r"data\.train_batch_size=8 is not valid with .*'nsr:nsr'"):  # fmt: skip
        _validated(f"{mini}=8")
    _validated(f"{mini}=4")
    _validated(f"{mini}=8", "actor_rollout_ref.actor.ppo_epochs=2")
    _validated(f"{mini}=8", "actor_rollout_ref.actor.policy_loss.loss_mode=nsr:hard")
    _validated(f"{mini}=8", "+actor_rollout_ref.actor.policy_loss.allow_on_policy=true")
    _validated(f"{mini}=8", "+actor_rollout_ref.actor.use_rollout_log_probs=true")


_WORKER = textwrap.dedent(
    """
    import sys, torch, verl
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass
    assert "nsr.verl" not in sys.modules
    actor = omega_conf_to_dataclass({  # as verl's actor worker: the actor config from the recipe's mapping
        "_target_": "verl.workers.config.ActorConfig", "strategy": "fsdp", "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 1,
        "policy_loss": {"_target_": "nsr.verl.NSRPolicyLossConfig", "loss_mode": "nsr:nsr"},
    })
    fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    x = torch.zeros(2, 3)
    loss, met = fn(x, x, torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), "token-mean", actor)
    try:  # verl's validate_config calls this right after building the actor config: the import patched it
        actor.validate(1, actor.ppo_mini_batch_size)
    except ValueError as e:
        assert "ppo_epochs=1" in str(e), e
    else:
        raise AssertionError("one update per step was not refused")
    print("OK", fn.__name__, float(met["actor/nsr_clip_frac"]))
    """
)


@pytest.mark.slow
def test_registration_reaches_a_fresh_worker_process():
    """A fresh interpreter that never imports nsr itself finds the modes once it builds the actor config from the
    recipe (what a Ray worker does): hydra imports the ``_target_``'s module, which registers them. (verl's other
    route, VERL_USE_EXTERNAL_MODULES, is checked by tests/test_verl_contract.py.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERL_USE_EXTERNAL_MODULES")}
    out = subprocess.run([sys.executable, "-c", _WORKER], env=env, cwd="/", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("OK compute_policy_loss_nsr_nsr 0.0")


ROUND_TRIP = [
    nsr.LossConfig(rule="nsr", delta=0.1, executor="clean"),
    nsr.LossConfig(rule="hard", eps_low=0.1, eps_high=0.4, dual_clip=5.0),
    nsr.LossConfig(rule="cispo", cispo_cap=None),
    nsr.LossConfig(rule="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0),
    nsr.LossConfig(rule="clean_decision", ratio_noise=0.1),
    nsr.LossConfig(rule="nsr", level="sequence"),
]


def test_recipe_overrides_round_trip():
    """recipe_overrides(loss), composed into verl's trainer config by hydra and read back as the worker does, is loss
    (every LossConfig field, so a sweep's grid point runs in a verl recipe as in this repo)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        for loss in ROUND_TRIP:
            overrides = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *nsr.verl.recipe_overrides(loss, 3)]
            actor_cfg = omega_conf_to_dataclass(compose("ppo_trainer", overrides=overrides).actor_rollout_ref.actor)
            assert nsr.verl.loss_config(loss.rule, actor_cfg) == loss
            assert actor_cfg.policy_loss.seed == 3


def test_cli_prints_a_sweeps_overrides(capsys, monkeypatch):
    from experiments.verl_overrides import main

    monkeypatch.chdir(ROOT)
    assert main(["--sweep", "sweeps/delta.yaml"]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(lines) > 5 and all(len(parts) == 2 and parts[1].startswith(README_LINES[0]) for parts in lines)
    assert any("+actor_rollout_ref.actor.policy_loss.delta=0.05" in parts[1] for parts in lines)
    assert main(["sweeps/presets/tiny.yaml", "loss.delta=2"]) == 2  # a bad value: the config's own error
    assert "loss.delta=2" in capsys.readouterr().err


@pytest.mark.parametrize("log_r", [50.0, -50.0])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_large_log_ratio_follows_verl(log_r, level):
    """|log r| = 50 on every token. Token level: verl's vanilla clamps log r at +-20 (nsr.LOG_RATIO_CLAMP) for its
    ratio and its ppo_kl; nsr:hard gives its loss, gradient and ppo_kl (-+20, not -+50). Sequence level: verl's gspo
    reports ppo_kl unclamped (-+50), and so does nsr:hard at level sequence."""
    logp, _, adv, mask = dual_batch(seed=4)
    batch = (logp, logp.detach() - log_r, adv, mask)
    if level == "token":
        ref = run("vanilla", actor("vanilla", PolicyLossConfig()), batch)
        got = run("nsr:hard", actor("nsr:hard"), batch)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
        assert (
            got[2]["actor/ppo_kl"]
            == pytest.approx(ref[2]["actor/ppo_kl"])
            == pytest.approx(-math.copysign(nsr.LOG_RATIO_CLAMP, log_r))
        )
    else:
        ref = run("gspo", actor("gspo", PolicyLossConfig(loss_mode="gspo")), batch)
        pl = nsr.verl.NSRPolicyLossConfig(loss_mode="nsr:hard", level="sequence")
        got = run("nsr:hard", actor("nsr:hard", pl), batch)
        assert got[2]["actor/ppo_kl"] == pytest.approx(ref[2]["actor/ppo_kl"]) == pytest.approx(-log_r)
    assert got[2]["actor/nsr_approx_kl"] == pytest.approx(-log_r)  # the kit's own metric: the raw log-ratio
