"""Contract with verl: fails loudly when the verl release, its policy-loss signature, registry, config classes or
the worker's call changes, so nsr.verl is re-checked before it silently misbehaves."""

import inspect
from dataclasses import fields

import pytest

pytest.importorskip("verl", reason="verl is installed by `make venv` (pip install --no-deps verl==0.9.1)")

import verl  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import nsr  # noqa: E402
import nsr.verl  # noqa: E402

VERL_MODES = {
    "bypass_mode", "cispo", "clip_cov", "dppo_kl", "dppo_tv", "dro", "geo_mean", "gpg", "gspo", "kl_cov", "sapo",
    "vanilla",
}  # fmt: skip


def test_pinned_release():
    assert verl.__version__ == nsr.verl.VERL_VERSION


def test_policy_loss_signature():
    want = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config", "rollout_is_weights"]
    for fn in (core_algos.compute_policy_loss_vanilla, nsr.verl.plugin.make_policy_loss("hard")):
        assert list(inspect.signature(fn).parameters) == want
    agg = list(inspect.signature(core_algos.agg_loss).parameters)
    assert agg[:3] == ["loss_mat", "loss_mask", "loss_agg_mode"]
    assert set(agg[3:]) >= {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}


def test_registry_and_lookup():
    reg = core_algos.POLICY_LOSS_REGISTRY
    assert isinstance(reg, dict) and VERL_MODES <= set(reg)
    assert not any(m.startswith(nsr.verl.PREFIX) for m in VERL_MODES)  # the prefix cannot collide
    assert nsr.verl.loss_modes() == [f"nsr:{r}" for r in nsr.RULES] and len(nsr.RULES) >= 9
    for mode in nsr.verl.loss_modes():
        assert core_algos.get_policy_loss_fn(mode).__module__ == "nsr.verl.plugin"
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        core_algos.get_policy_loss_fn("nsr:not-a-rule")


def test_rules_added_later_become_modes():
    name = "contract_probe"
    nsr.RULES.register(name)(nsr.RULES["hard"])
    try:
        assert f"nsr:{name}" in nsr.verl.register()
        assert core_algos.get_policy_loss_fn(f"nsr:{name}").__name__ == f"compute_policy_loss_nsr_{name}"
    finally:
        nsr.RULES._items.pop(name)
        core_algos.POLICY_LOSS_REGISTRY.pop(f"nsr:{name}")


def test_a_foreign_mode_under_our_name_is_refused():
    mine = core_algos.POLICY_LOSS_REGISTRY["nsr:hard"]
    core_algos.POLICY_LOSS_REGISTRY["nsr:hard"] = core_algos.compute_policy_loss_vanilla
    try:
        with pytest.raises(RuntimeError, match="already registered"):
            nsr.verl.register()
    finally:
        core_algos.POLICY_LOSS_REGISTRY["nsr:hard"] = mine


def test_config_classes():
    names = {f.name for f in fields(PolicyLossConfig)}
    assert {"loss_mode", "_target_"} <= names
    assert not names & {f.name for f in fields(nsr.verl.NSRPolicyLossConfig)} - names - {"_target_"}
    actor = {f.name for f in fields(ActorConfig)}
    assert {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg", "policy_loss"} <= actor
    assert {"global_batch_info", "loss_agg_mode"} <= actor


def test_worker_calls_the_registry_with_the_actor_config():
    """verl's actor worker looks the mode up by name and builds its config from the recipe through _target_."""
    from importlib.util import find_spec

    from verl.workers.utils import losses

    src = inspect.getsource(losses.ppo_loss)
    assert 'loss_mode = config.policy_loss.get("loss_mode", "vanilla")' in src
    assert "policy_loss_fn = get_policy_loss_fn(loss_mode)" in src
    for kw in ("old_log_prob=", "log_prob=", "advantages=", "response_mask=", "loss_agg_mode=", "config=config"):
        assert kw in src
    worker = open(find_spec("verl.workers.engine_workers").origin).read()  # imports GPU-only packages: read it
    assert "omega_conf_to_dataclass(self.config.actor)" in worker


def test_every_loss_config_field_travels():
    """Every nsr.LossConfig field (fields added later too) is a verl actor key or an NSRPolicyLossConfig field with
    the same default, and OmegaConf accepts the subclass as a structured config (hydra builds it from YAML)."""
    from omegaconf import OmegaConf

    from nsr.verl.plugin import _VERL_KEYS, LOSS_KEYS

    ours = {f.name: f.default for f in fields(nsr.LossConfig)}
    assert set(ours) == {"rule", *_VERL_KEYS, *LOSS_KEYS}
    sub = {f.name: f.default for f in fields(nsr.verl.NSRPolicyLossConfig)}
    assert all(sub[k] == ours[k] for k in LOSS_KEYS)
    assert OmegaConf.to_object(OmegaConf.structured(nsr.verl.NSRPolicyLossConfig)) == nsr.verl.NSRPolicyLossConfig()


def test_verl_imports_external_modules_in_every_process():
    """``import verl`` imports the comma-separated modules of VERL_USE_EXTERNAL_MODULES (verl/__init__.py), so
    VERL_USE_EXTERNAL_MODULES=nsr.verl registers the modes in every process without the ``_target_`` line."""
    from importlib.util import find_spec

    src = open(find_spec("verl").origin).read()
    assert 'modules = os.getenv("VERL_USE_EXTERNAL_MODULES", "")' in src
    assert "import_external_libs(modules)" in src
