"""The launcher's checks before Ray starts (OpenRLHF's real parser and checks, then the NSR layer's refusals from
nsr/openrlhf/mapping.py), its exit status, the --nsr flags generated from the config dataclasses, and the one seed
hash every random stream uses."""

import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from experiments.config import ConfigError, load_config
from experiments.openrlhf.argv import build_command
from nsr import AdvantageConfig, LossConfig, seeds
from nsr import seeds as rng
from nsr.openrlhf import launch, mapping
from nsr.openrlhf.loss import NSRPolicyLoss
from nsr.openrlhf.settings import NSRSettings

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml"
CPU_PRESET = ROOT / "sweeps" / "presets" / "smollm2-openrlhf-cpu.yaml"


def _argv(*overrides, extra=()):
    cfg = load_config(PRESET, ["openrlhf.dynamic_filtering=false", "openrlhf.overlong_buffer_len=0", *overrides])
    cmd = build_command(cfg, "/tmp/nsr-launch-test", "x")
    return cmd.nsr_argv + cmd.openrlhf_argv + list(extra)


def test_a_preset_command_passes_every_check():
    settings, rest = launch.prepare(_argv("loss.rule=nsr"))
    assert settings.rule == "nsr" and settings.max_steps == 400 and "--ckpt.max_num" in rest


def test_one_step_per_rollout_is_refused_by_the_launcher():
    """A plain OpenRLHF command (not built by the kit) with one optimizer step per rollout: every ratio is 1, so a rule
    that needs stale ratios is refused naming the flags; hard, --train.max_epochs 2 and --nsr.allow_on_policy pass.
    The kit's train.allow_on_policy=true command carries --nsr.allow_on_policy."""
    one = ["--train.batch_size", "8192"]  # 512 prompts x 16 samples: the whole rollout in one step
    argv = _argv("loss.rule=nsr")
    want = r"--rollout\.batch_size 512 x --rollout\.n_samples_per_prompt 16 / --train\.batch_size 8192 x "
    with pytest.raises(launch.LaunchError, match=want + r"--train\.max_epochs 1 = 1 optimizer step"):
        launch.prepare(argv + one)
    launch.prepare(argv + one + ["--nsr.allow_on_policy", "true"])
    launch.prepare(argv + one + ["--train.max_epochs", "2"])
    launch.prepare(_argv("loss.rule=hard") + one)
    kit = _argv("openrlhf.train_batch_size=8192", "train.minibatches=1", "train.epochs=1", "train.allow_on_policy=true",
                "loss.rule=nsr")  # fmt: skip
    assert "--nsr.allow_on_policy" in kit
    launch.prepare(kit)


REFUSED = [
    (("loss.rule=nsr",), ["--ds.ring_attn_size", "2"], "--ds.ring_attn_size=2 is not supported.*allowed: 1"),
    (("loss.rule=nsr",), ["--ds.tensor_parallel_size", "2"], "--ds.tensor_parallel_size=2 is not supported"),
    (
        ("advantages.kind=random_reward",),
        ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1"],
        "random_reward with dynamic filtering",
    ),
    (
        ("advantages.kind=random_reward",),
        ["--reward.overlong_buffer_len", "512", "--reward.overlong_penalty_factor", "1.0"],
        "random_reward with an overlong penalty",
    ),
    (("loss.rule=nsr",), ["--algo.advantage.is_correction_level", "token"], "vLLM IS correction.*allowed: off"),
    (
        ("advantages.kind=no_std",),
        ["--algo.advantage.estimator", "group_norm"],
        "needs --algo.advantage.estimator dr_grpo",
    ),
    (("train.dgg=true",), ["--ds.zero_stage", "0"], r"--nsr.dgg with --ds.zero_stage=0.*allowed: --ds.zero_stage 1"),
    (("train.dgg=true",), ["--ds.param_dtype", "fp16"], r"--nsr.dgg with --ds.param_dtype=fp16.*allowed: .*bf16"),
    (("train.dgg=true",), ["--ds.lora.rank", "8"], r"--nsr.dgg with --ds.lora.rank=8: the lm_head is frozen"),
    (("train.dgg=true",), ["--ds.load_in_4bit"], r"--nsr.dgg with --ds.load_in_4bit"),
    (("train.dgg=true",), ["--actor.optim", "muon"], r"--nsr.dgg with --actor.optim muon.*allowed: adam"),
    (
        ("train.dgg=true",),
        ["--ds.zero_stage", "1", "--ds.grad_accum_dtype", "fp32"],
        r"--nsr.dgg with --ds.grad_accum_dtype fp32 with --ds.zero_stage 1: .*BF16_Optimizer",
    ),
    (("train.dgg=true",), ["--ds.deepcompile"], r"--nsr.dgg with --ds.deepcompile"),
    (("train.dgg=true",), ["--train.dynamic_batch_enable"], r"--nsr.dgg with --train.dynamic_batch_enable"),
]


def test_dgg_flags_reach_the_settings_and_bad_ones_are_refused_before_ray():
    settings, _ = launch.prepare(_argv("train.dgg=true", "train.dgg_k=2.5", "train.dgg_window=7"))
    assert (settings.dgg, settings.dgg_k, settings.dgg_window) == (True, 2.5, 7)
    assert launch.prepare(_argv())[0].dgg is False
    with pytest.raises(launch.LaunchError, match=r"--nsr.dgg_k=1.0 is not valid; allowed: a finite number > 1"):
        launch.prepare(_argv("train.dgg=true", extra=["--nsr.dgg_k", "1.0"]))
    cfg = load_config(CPU_PRESET, ["train.dgg=true", "openrlhf.bf16=false"])
    with pytest.raises(ConfigError, match=r"openrlhf.bf16=false with train.dgg=true.*bfloat16 only; allowed: true"):
        build_command(cfg, "/tmp/nsr-launch-test", "x")
    with pytest.raises(launch.LaunchError, match=r"--nsr.dgg with --nsr.fp32.*allowed: --nsr.fp32 false"):
        launch.prepare(_argv("train.dgg=true", extra=["--nsr.fp32", "true"]))


def test_record_batches_reach_the_settings_and_bad_ones_are_refused():
    """logging.record_batches becomes --nsr.record_steps / --nsr.record_dir (nsr/openrlhf/record.py writes the files);
    refused on the other backends, beyond train.steps, and as half a flag pair."""
    settings, _ = launch.prepare(_argv("logging.record_batches=[1, 3]"))
    assert settings.recorded_steps() == {1, 3} and settings.record_dir == "/tmp/nsr-launch-test/batches"
    assert launch.prepare(_argv())[0].recorded_steps() == frozenset()
    with pytest.raises(ConfigError, match=r"record_batches=\[1\] is not valid with backend='tiny'.*allowed here: \[\]"):
        load_config(ROOT / "sweeps" / "presets" / "tiny.yaml", ["logging.record_batches=[1]"])
    with pytest.raises(ConfigError, match=r"record_batches=\[9\] is not valid; allowed: RL steps of this run, 1..tra"):
        load_config(CPU_PRESET, ["logging.record_batches=[9]", "train.steps=8"])
    with pytest.raises(ConfigError, match=r"record_batches=\[2, 2\] is not valid; allowed: distinct RL steps"):
        load_config(CPU_PRESET, ["logging.record_batches=[2, 2]"])
    with pytest.raises(launch.LaunchError, match=r"--nsr.record_steps='1,x' is not valid; allowed: RL steps >= 1"):
        launch.prepare(_argv(extra=["--nsr.record_steps", "1,x", "--nsr.record_dir", "/tmp/b"]))
    with pytest.raises(launch.LaunchError, match=r"--nsr.record_dir='': allowed: both set or both empty"):
        launch.prepare(_argv(extra=["--nsr.record_steps", "2"]))


def test_fp32_is_a_cpu_runs_and_refused_elsewhere(tmp_path):
    """openrlhf.bf16=false: --nsr.fp32 on a CPU preset (no --ds.param_dtype: OpenRLHF's has no float32), refused on a
    GPU preset by the config, by the launcher without the CPU shim's switch, and with a --ds.param_dtype beside it."""
    cmd = build_command(load_config(CPU_PRESET, ["openrlhf.bf16=false"]), tmp_path, "x")
    assert "--ds.param_dtype" not in cmd.openrlhf_argv and cmd.nsr_argv[-2:] == ["--nsr.fp32", "True"]
    assert cmd.env[launch.CPU_ENV] == "1"
    assert launch.prepare(cmd.argv[3:])[0].fp32 is True
    with pytest.raises(launch.LaunchError, match=r"--nsr.fp32 with --ds.param_dtype fp16.*leave --ds.param_dtype out"):
        launch.prepare(cmd.argv[3:] + ["--ds.param_dtype", "fp16"])
    bf16 = build_command(load_config(CPU_PRESET), tmp_path, "x")
    assert bf16.openrlhf_argv[bf16.openrlhf_argv.index("--ds.param_dtype") + 1] == "bf16"
    assert "--nsr.fp32" not in bf16.nsr_argv and launch.prepare(bf16.argv[3:])[0].fp32 is False
    with pytest.raises(ConfigError, match="openrlhf.bf16=false is not valid on a GPU run"):
        build_command(load_config(PRESET, ["openrlhf.bf16=false"]), tmp_path, "x")
    env = {k: v for k, v in os.environ.items() if k != launch.CPU_ENV}
    p = subprocess.run([sys.executable, "-m", "nsr.openrlhf.launch", *cmd.argv[3:]], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env=env)  # fmt: skip
    assert p.returncode == launch.EXIT_REFUSED and "--nsr.fp32 without NSR_OPENRLHF_CPU=1" in p.stderr, p.stderr


@pytest.mark.parametrize("overrides,extra,match", REFUSED)
def test_unsupported_openrlhf_options_are_refused_before_ray(overrides, extra, match):
    argv = _argv(*overrides)
    # the later flag wins in argparse: the refused value replaces the preset's
    with pytest.raises(launch.LaunchError, match=match):
        launch.prepare(argv + extra)


def test_the_maps_are_inverse_and_name_what_is_allowed():
    assert {mapping.level_of(t): t for t in mapping.LOSS_TYPE.values()} == {v: k for k, v in mapping.LEVEL.items()}
    assert all(mapping.level_of(mapping.LOSS_TYPE[lv]) == lv for lv in ("token", "sequence"))
    with pytest.raises(ValueError, match="policy_loss_type='cispo' is not supported.*allowed: ppo, gspo"):
        mapping.level_of("cispo")
    assert set(mapping.ESTIMATOR) == set(typing.get_args(typing.get_type_hints(AdvantageConfig)["kind"]))


def test_one_kept_checkpoint_is_refused():
    """--ckpt.max_num 1: OpenRLHF deletes the old checkpoint before writing the new one (unresumable window)."""
    with pytest.raises(launch.LaunchError, match="--ckpt.max_num=1 with --ckpt.load_enable.*allowed: >= 2"):
        launch.prepare(_argv(extra=["--ckpt.max_num", "1"]))


def test_refused_commands_exit_with_status_2():
    p = subprocess.run(
        [sys.executable, "-m", "nsr.openrlhf.launch", "--nsr.rule", "nsrr"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "nsr.openrlhf.launch: error:" in p.stderr and "allowed: hard, nsr" in p.stderr


# ---------------------------------------------------------------- --nsr flags from the dataclass fields
def test_every_config_field_is_a_flag_except_those_openrlhf_sets():
    parser_flags = set()
    import argparse

    parser = argparse.ArgumentParser()
    NSRSettings.add_arguments(parser)
    parser_flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--nsr.")}
    loss = {f"--nsr.{f.name}" for f in dataclasses.fields(LossConfig) if f.name not in mapping.FROM_OPENRLHF}
    adv = {f"--nsr.adv_{f.name}" for f in dataclasses.fields(AdvantageConfig)}
    own = {"--nsr.metrics_path", "--nsr.max_steps", "--nsr.dgg", "--nsr.dgg_k", "--nsr.dgg_window"}
    own |= {"--nsr.allow_on_policy", "--nsr.fp32", "--nsr.record_steps", "--nsr.record_dir"}
    assert parser_flags == loss | adv | own


def test_flag_types_come_from_the_field_types():
    s, rest = NSRSettings.parse(
        ["--nsr.rule", "nsr", "--nsr.delta", "0.1", "--nsr.adv_noise", "0.5", "--nsr.max_steps", "7", "--x", "1"]
    )
    assert rest == ["--x", "1"]
    assert s.loss == {"rule": "nsr", "delta": 0.1} and s.advantages.noise == 0.5 and s.max_steps == 7
    assert NSRSettings.parse(["--nsr.delta", "None"])[0].loss == {"delta": None}  # float | None
    with pytest.raises(ValueError, match="invalid choice: 'median'.*'mult', 'add'"):  # a Literal's choices
        NSRSettings.parse(["--nsr.adv_noise_mode", "median"])
    with pytest.raises(ValueError, match="invalid float or None value: 'x'"):
        NSRSettings.parse(["--nsr.delta", "x"])
    with pytest.raises(ValueError, match="unknown flag '--nsr.eps_low'.*allowed --nsr flags"):
        NSRSettings.parse(["--nsr.eps_low", "0.1"])  # set by --actor.eps_clip_low_high


def test_settings_round_trip_through_the_command_line():
    loss = LossConfig(rule="noisy_decision", level="sequence", delta=1e-4, ratio_noise=0.2, executor="clean")
    adv = AdvantageConfig(kind="positive_only", noise=0.3, noise_mode="add")
    s = NSRSettings.from_configs(loss, adv, metrics_path="/r/metrics.jsonl", max_steps=9)
    back, rest = NSRSettings.parse(s.to_argv())
    assert back == s and rest == []
    assert back.loss_config(loss.eps_low, loss.eps_high, None, "sequence") == loss


# ---------------------------------------------------------------- one seed hash
def test_one_seed_hash_for_the_testbed_and_the_cluster_loss():
    assert rng.derive_seed is seeds.derive_seed and rng.generator is seeds.generator
    fn = NSRPolicyLoss(settings=NSRSettings.make(rule="nsr"), seed=3, rank=1)
    fn.start_step(5)
    g = fn.generator(torch.device("cpu"))
    assert g.initial_seed() == seeds.derive_seed("loss", 3, 1, 5, 0)
    assert seeds.derive_seed(0, 1, "rollout") != seeds.derive_seed(0, 2, "rollout")
