"""RunConfig: YAML round trip, typed overrides, clear errors, stable run ids."""

import pytest

from experiments.config import ConfigError, RunConfig, apply_overrides, from_dict, load_config


def test_yaml_round_trip_and_hash_is_stable(tmp_path):
    cfg = from_dict(apply_overrides(RunConfig().to_dict(), ["loss.rule=nsr", "train.lr=1e-4", "seed=3"]))
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg and again.run_hash() == cfg.run_hash()
    assert cfg.train.lr == 1e-4 and cfg.loss.rule == "nsr" and cfg.seed == 3
    assert cfg.run_hash() != RunConfig().run_hash()


def test_logging_does_not_change_the_run_id():
    a = RunConfig()
    b = from_dict(apply_overrides(a.to_dict(), ["logging.progress=false", "logging.checkpoint_every=7"]))
    assert a.run_hash() == b.run_hash() and a != b


def test_explicit_defaults_hash_like_implicit_ones():
    a = from_dict({"loss": {"rule": "nsr"}})
    b = from_dict({"loss": {"rule": "nsr", "delta": 0.2, "eps_low": 0.2, "eps_high": 0.28}})
    assert a.run_hash() == b.run_hash()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.rule=nope"], r"loss\.rule='nope'.*allowed: hard, nsr"),
        (["train.lrr=1"], r"unknown key 'train\.lrr'; allowed keys in train: steps, lr"),
        (["bogus=1"], r"unknown key 'bogus'"),
        (["train.lr=abc"], r"train\.lr='abc'.*a finite number"),
        (["seed=1.5"], r"seed=1\.5.*an integer"),
        (["loss.delta=2"], r"loss\.delta=2\.0.*0 <= delta < 1"),
        (["rollout.samples_per_prompt=1"], r"rollout\.samples_per_prompt=1.*>= 2"),
        (["train.epochs=1", "train.minibatches=1"], r"train\.epochs \* train\.minibatches = 1.*one optimizer step"),
        (["train.minibatches=7"], r"train\.minibatches=7.*a divisor of"),
        (["backend=jax"], r"backend='jax'.*tiny, openrlhf"),
        (["loss=3"], r"loss must be a mapping"),
        (["train.adam_betas=[0.9]"], r"train\.adam_betas=\[0\.9\].*a list of 2"),
        (["advantages.kind=std"], r"advantages\.kind='std'.*group_norm"),
    ],
)
def test_bad_values_name_file_key_and_allowed_values(overrides, message):
    with pytest.raises(ConfigError, match=r"^cfg\.yaml: " + message):
        from_dict(apply_overrides(RunConfig().to_dict(), overrides), source="cfg.yaml")


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(_write(tmp_path), ["seed"])


def _write(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("seed: 1\n")
    return p
