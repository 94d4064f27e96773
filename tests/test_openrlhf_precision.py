"""``python -m experiments.openrlhf.precision``'s refusals, before any model work. The replay itself runs on a real
OpenRLHF run's recorded batch in tests/test_openrlhf_e2e.py (the float32 run: per micro-batch the same clipped share
and largest |r - 1| as the run logged, the meter's row equal to the run's)."""

import pytest

from experiments.config import load_config
from experiments.config_errors import ConfigError
from experiments.openrlhf import precision
from experiments.rundir import REPO_ROOT

PRESET = REPO_ROOT / "sweeps" / "presets" / "openrlhf-cpu.yaml"


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.weight_decay=0.1"], r"train.weight_decay=0.1 is not valid for the precision replay; allowed: 0.0"),
        (["openrlhf.lr_scheduler=cosine_with_min_lr"], r"openrlhf.lr_scheduler=.*allowed: constant, or constant_with"),
        (["train.kl_coef=0.01"], r"train.kl_coef='0.01 / 0.0' is not valid.*allowed: 0.0 and 0.0"),
        (["loss.level=sequence", "loss.rule=hard"], r"loss.level='sequence' is not valid.*allowed: token"),
    ],
)
def test_what_the_replay_does_not_model_is_refused(tmp_path, overrides, match):
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "step1-rank0.pt").write_bytes(b"")
    cfg = load_config(PRESET, overrides)
    with pytest.raises(ConfigError, match=match):
        precision.check(cfg, tmp_path)


def test_a_run_without_its_step1_batch_is_refused(tmp_path, capsys):
    cfg = load_config(PRESET)
    with pytest.raises(ConfigError, match=r"recorded no step-1 batch; allowed: a run with logging.record_batches"):
        precision.check(cfg, tmp_path)
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    assert precision.main([str(tmp_path)]) == 2
    assert "recorded no step-1 batch" in capsys.readouterr().err


def test_another_backend_is_refused(tmp_path):
    cfg = load_config(REPO_ROOT / "sweeps" / "presets" / "tiny.yaml")
    with pytest.raises(ConfigError, match=r"backend='tiny' is not valid for the precision replay; allowed: openrlhf"):
        precision.check(cfg, tmp_path)
