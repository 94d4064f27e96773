"""RunConfig -> launcher argv, checked with OpenRLHF 0.11.2's real parser and checks (built from the installed
source, nsr.openrlhf.cli): for every cluster preset and every rule the command is accepted, and every parsed value
equals the RunConfig's."""

from pathlib import Path

import pytest

import nsr
from experiments.config import ConfigError, RunConfig, load_config
from experiments.openrlhf.argv import LAUNCHER, REWARD_FILE, build_command
from nsr.openrlhf.cli import CLIError, build_parser, parse
from nsr.openrlhf.settings import NSRSettings

PRESETS = Path(__file__).resolve().parents[1] / "sweeps" / "presets"
CLUSTER = ["qwen2.5-math-7b-dapo", "qwen3-8b-dapo", "qwen3-30b-a3b-gspo"]


def _cfg(preset, overrides=()):
    return load_config(PRESETS / f"{preset}.yaml", list(overrides))


def _overrides_for(rule):
    return [f"loss.rule={rule}"] + (["loss.ratio_noise=0.1"] if rule.endswith("_decision") else [])


def assert_parsed_equals_config(args, cfg, run_dir: Path, run_id: str):
    """Every OpenRLHF value the RunConfig determines, read back from OpenRLHF's own parsed args."""
    o, r, t, loss = cfg.openrlhf, cfg.rollout, cfg.train, cfg.loss
    assert args.actor.model_name_or_path == cfg.model.name
    assert Path(args.data.prompt_dataset) == Path(cfg.task.train_data).absolute()
    assert (args.data.input_key, args.data.label_key) == ("prompt", "label")
    assert args.data.apply_chat_template is cfg.task.chat_template
    assert args.data.max_len == cfg.task.max_prompt_len + r.max_new_tokens
    headroom = 3 if o.dynamic_filtering else 1  # filtered prompts are replaced: the loader holds 3x as many
    assert args.data.max_samples == t.steps * r.prompts_per_step * headroom and args.train.num_episodes == 1
    assert args.reward.remote_url == [str(REWARD_FILE)]
    assert args.rollout.batch_size == r.prompts_per_step
    assert args.rollout.n_samples_per_prompt == r.samples_per_prompt
    assert args.rollout.temperature == r.temperature
    assert args.rollout.max_new_tokens == r.max_new_tokens
    assert args.rollout.micro_batch_size == o.micro_rollout_batch_size
    assert args.train.seed == cfg.seed
    assert args.train.batch_size == o.train_batch_size
    assert args.train.micro_batch_size == o.micro_train_batch_size
    assert args.train.max_epochs == t.epochs
    assert args.actor.adam.lr == t.lr
    assert tuple(args.actor.adam.betas) == tuple(t.adam_betas)
    assert args.actor.adam.weight_decay == t.weight_decay
    assert args.actor.max_norm == t.grad_clip
    # OpenRLHF's schedule length is max_samples x samples / batch: the warmup still lasts ratio x train.steps
    assert args.actor.lr_scheduler == o.lr_scheduler
    assert args.actor.lr_warmup_ratio * args.data.max_samples == pytest.approx(
        o.lr_warmup_ratio * t.steps * r.prompts_per_step
    )
    # None unless a bonus is asked for: any value makes OpenRLHF keep a (tokens x vocab) fp32 tensor
    assert args.actor.entropy_coef == (t.entropy_coef or None)
    assert args.actor.policy_loss_type == {"token": "ppo", "sequence": "gspo"}[loss.level]
    assert args.actor.loss_agg_mode == t.agg_mode
    assert tuple(args.actor.eps_clip_low_high) == (loss.eps_low, loss.eps_high)
    assert args.actor.dual_clip == loss.dual_clip
    want_est = {"no_std": "dr_grpo"}.get(cfg.advantages.kind, "group_norm")
    assert args.algo.advantage.estimator == want_est
    assert args.algo.kl.init_coef == t.kl_coef and args.algo.kl.use_loss is (t.kl_coef > 0)
    assert (args.actor.num_nodes, args.actor.num_gpus_per_node) == (o.nodes, o.gpus_per_node)
    assert (args.vllm.num_engines, args.vllm.tensor_parallel_size) == (o.vllm_engines, o.vllm_tensor_parallel)
    assert args.vllm.gpu_memory_utilization == o.vllm_gpu_memory_utilization
    # bf16, or float32 through the launcher's --nsr.fp32 (a CPU run; OpenRLHF's flag has no float32)
    assert args.ds.zero_stage == o.zero_stage and args.ds.param_dtype == "bf16"
    assert args.actor.gradient_checkpointing_enable is o.gradient_checkpointing
    assert args.ds.packing_samples is o.packing_samples
    assert args.train.colocate_all is o.colocate_all
    assert args.vllm.enable_sleep is o.colocate_all and args.ds.enable_sleep is o.colocate_all
    assert args.algo.dynamic_filtering_enable is o.dynamic_filtering
    assert args.reward.overlong_buffer_len == (o.overlong_buffer_len or None)
    assert args.ckpt.save_steps == o.save_steps and args.ckpt.save_hf and args.ckpt.load_enable
    assert args.ckpt.max_num >= 2  # a preemption while one is written leaves the previous one
    assert Path(args.ckpt.path) == run_dir / "ckpt"
    assert Path(args.logger.tensorboard_dir) == run_dir / "tensorboard" and args.logger.wandb.run_name == run_id
    assert args.logger.wandb.key is None  # offline: TensorBoard only


def _check_command(cfg, tmp_path):
    cmd = build_command(cfg, tmp_path / "run", "run-1234abcd", python="python")
    assert cmd.argv[:3] == ["python", "-m", LAUNCHER]
    settings, rest = NSRSettings.parse(cmd.argv[3:])
    assert rest == cmd.openrlhf_argv  # the launcher hands OpenRLHF exactly openrlhf_argv
    level = cfg.loss.level
    assert settings.loss_config(cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.dual_clip, level) == cfg.loss
    assert settings.advantages == cfg.advantages
    assert Path(settings.metrics_path) == tmp_path / "run" / "metrics.jsonl"
    assert settings.max_steps == cfg.train.steps  # every arm stops at train.steps
    assert settings.fp32 is (not cfg.openrlhf.bf16)
    args = parse(cmd.openrlhf_argv)  # OpenRLHF's parser and every check of its __main__ block
    assert_parsed_equals_config(args, cfg, tmp_path / "run", "run-1234abcd")
    return args


def test_the_parser_is_openrlhfs():
    parser = build_parser()
    assert len(parser._actions) > 150
    with pytest.raises(CLIError, match="unrecognized arguments: --eps_clip"):  # pre-0.11 flat flags are gone
        parse(["--eps_clip", "0.2"])


PRESET_LEVEL = {"qwen2.5-math-7b-dapo": "token", "qwen3-8b-dapo": "token", "qwen3-30b-a3b-gspo": "sequence"}


@pytest.mark.parametrize(
    "preset,rule",
    [(p, r) for p in CLUSTER for r in nsr.RULES if PRESET_LEVEL[p] in nsr.RULES.info(r)["levels"]],
)
def test_every_preset_and_rule_is_accepted_by_openrlhf(preset, rule, tmp_path):
    assert _cfg(preset).loss.level == PRESET_LEVEL[preset]
    _check_command(_cfg(preset, _overrides_for(rule)), tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        ["advantages.kind=no_std"],
        ["advantages.kind=positive_only", "advantages.noise=0.5", "advantages.noise_mode=add"],
        ["advantages.kind=random_reward", "openrlhf.dynamic_filtering=false", "openrlhf.overlong_buffer_len=0"],
        ["train.entropy_coef=0.001"],
        ["loss.dual_clip=3.0", "train.kl_coef=0.001", "seed=7"],
        ["openrlhf.colocate_all=false", "openrlhf.dynamic_filtering=false", "openrlhf.overlong_buffer_len=0"],
        ["train.epochs=2", "task.chat_template=false", "openrlhf.gradient_checkpointing=false"],
    ],
)
def test_interventions_map_onto_openrlhf_flags(overrides, tmp_path):
    _check_command(_cfg("qwen2.5-math-7b-dapo", overrides), tmp_path)


def test_presets_give_many_optimizer_steps_per_rollout():
    from experiments.openrlhf.argv import optimizer_steps_per_rollout

    assert [optimizer_steps_per_rollout(_cfg(p)) for p in CLUSTER] == [16, 16, 8]


REFUSALS = [
    (["openrlhf.train_batch_size=8192"], r"one optimizer step per rollout.*8192 / 8192 x 1 = 1\)"),
    (
        ["openrlhf.train_batch_size=512", "train.minibatches=4"],
        "train.minibatches=4 does not match.*allowed: train.minibatches=16, or for train.minibatches=4: "
        "openrlhf.train_batch_size=2048 openrlhf.micro_train_batch_size=4 "
        r"\(or openrlhf.train_batch_size=0: derived",
    ),
    (["openrlhf.train_batch_size=500"], "openrlhf.train_batch_size=500 is not valid; allowed: a divisor"),
    (
        ["openrlhf.train_batch_size=512", "openrlhf.micro_train_batch_size=128"],
        "train_batch_size=512 is not valid for DeepSpeed with openrlhf.micro_train_batch_size=128.*e.g. for "
        "train.minibatches=16: openrlhf.train_batch_size=512 openrlhf.micro_train_batch_size=64",
    ),
    (["openrlhf.bf16=false"], "openrlhf.bf16=false is not valid on a GPU run.*allowed: true"),
    (["openrlhf.vllm_engines=4"], "must equal nodes x gpus_per_node = 8"),
    (["loss.level=sequence"], "train.agg_mode='token-mean' is not valid with loss.level='sequence'"),
    (["openrlhf.extra_args=[--actor.adam.lr, '1e-5']"], "extra_args sets --actor.adam.lr"),
    (["openrlhf.extra_args=[--nsr.rule, nsr]"], "OpenRLHF flags only"),
    (["task.train_data=''"], "task.train_data='' is not valid"),
    (["openrlhf.overlong_buffer_len=3072"], "overlong_buffer_len=3072 is not valid"),
    # the random-reward control must be prompt- and length-neutral
    (["advantages.kind=random_reward"], "random_reward with dynamic filtering.*allowed: openrlhf.dynamic_filtering"),
    (
        ["advantages.kind=random_reward", "openrlhf.dynamic_filtering=false"],
        "random_reward with an overlong penalty.*allowed: openrlhf.overlong_buffer_len=0",
    ),
    (["eval.every=30"], "eval.every=30 is not valid with openrlhf.save_steps=50.*allowed: a multiple of 50"),
    (["openrlhf.lr_scheduler=cosine_with_min_lr"], "lr_scheduler='cosine_with_min_lr' with openrlhf.dynamic_filtering"),
]


@pytest.mark.parametrize("overrides,match", REFUSALS)
def test_refusals_name_the_keys(overrides, match, tmp_path):
    cfg = _cfg("qwen2.5-math-7b-dapo", overrides)
    with pytest.raises(ConfigError, match=match):
        build_command(cfg, tmp_path, "x")
    assert not (tmp_path / "ckpt").exists()


PRESET_BATCH = {
    "openrlhf-cpu": (8, 4),
    "smollm2-openrlhf-cpu": (32, 8),
    "smollm2-openrlhf-cpu-fp32": (32, 8),
    "qwen2.5-math-7b-dapo": (512, 4),
    "qwen3-8b-dapo": (512, 2),
    "qwen3-30b-a3b-gspo": (512, 1),
}
"""(openrlhf.train_batch_size, micro_train_batch_size) each OpenRLHF preset set before the batch was derived."""


@pytest.mark.parametrize("preset", sorted(PRESET_BATCH))
def test_the_presets_derive_the_batch_they_set_before(preset):
    """``train_batch_size: 0`` in the preset file; the RunConfig holds the number train.minibatches implies, which is
    the one the file held before: the same config dict, so the same run id."""
    import yaml

    assert yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())["openrlhf"]["train_batch_size"] == 0
    batch, micro = PRESET_BATCH[preset]
    cfg = _cfg(preset)
    explicit = _cfg(preset, [f"openrlhf.train_batch_size={batch}", f"openrlhf.micro_train_batch_size={micro}"])
    assert (cfg.openrlhf.train_batch_size, cfg.openrlhf.micro_train_batch_size) == (batch, micro)
    assert cfg.to_dict() == explicit.to_dict() and cfg.run_hash() == explicit.run_hash()
    assert load_config_text(cfg.to_yaml()).run_hash() == cfg.run_hash()  # config.yaml holds the number


def load_config_text(text: str) -> RunConfig:
    import yaml

    from experiments.config import from_dict

    return from_dict(yaml.safe_load(text))


def test_minibatches_set_the_batch_they_imply(tmp_path):
    """train.minibatches=16 on the SmolLM2 CPU preset: 64 samples / 16 = 4 per optimizer step, the micro-batch of 8
    lowered to 4; the same run as the one that sets both batch fields by hand."""
    from experiments.openrlhf.argv import optimizer_steps_per_rollout

    cfg = _cfg("smollm2-openrlhf-cpu", ["train.minibatches=16", "openrlhf.dynamic_filtering=true"])
    assert (cfg.openrlhf.train_batch_size, cfg.openrlhf.micro_train_batch_size) == (4, 4)
    by_hand = ["train.minibatches=16", "openrlhf.dynamic_filtering=true"]
    by_hand += ["openrlhf.train_batch_size=4", "openrlhf.micro_train_batch_size=4"]
    assert cfg.run_hash() == _cfg("smollm2-openrlhf-cpu", by_hand).run_hash()
    assert optimizer_steps_per_rollout(cfg) == 16
    args = parse(build_command(cfg, tmp_path, "x").openrlhf_argv)  # OpenRLHF's parser and checks
    assert (args.train.batch_size, args.train.micro_batch_size) == (4, 4)
    # a cluster preset: 8192 samples / 8 = 1024 per step; the micro-batch of 2 fits 1024 / 16 ranks
    big = _cfg("qwen3-8b-dapo", ["train.minibatches=8"])
    assert (big.openrlhf.train_batch_size, big.openrlhf.micro_train_batch_size) == (1024, 2)
    assert optimizer_steps_per_rollout(big) == 8
    # a micro-batch larger than the derived batch per rank is lowered to it (and recorded so)
    fit = _cfg("qwen2.5-math-7b-dapo", ["openrlhf.micro_train_batch_size=128"])
    assert (fit.openrlhf.train_batch_size, fit.openrlhf.micro_train_batch_size) == (512, 64)


@pytest.mark.parametrize(
    "preset,minibatches,allowed",
    [
        ("smollm2-openrlhf-cpu", 3, "1, 2, 4, 8, 16, 32, 64"),
        ("qwen2.5-math-7b-dapo", 2048, "1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024$"),  # 8 ranks
    ],
)
def test_a_minibatch_count_that_does_not_split_the_rollout_is_refused(preset, minibatches, allowed):
    with pytest.raises(ConfigError, match=rf"train.minibatches={minibatches} is not valid with "
                       rf"openrlhf.train_batch_size=0 \(derived.*allowed: {allowed}"):  # fmt: skip
        _cfg(preset, [f"train.minibatches={minibatches}"])


def test_tiny_configs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="backend='tiny' is not valid here; allowed: openrlhf"):
        build_command(RunConfig(), tmp_path, "x")


def test_allow_on_policy_lets_one_step_through(tmp_path):
    cfg = _cfg(
        "qwen2.5-math-7b-dapo",
        ["openrlhf.train_batch_size=8192", "train.minibatches=1", "train.epochs=1", "train.allow_on_policy=true"],
    )
    args = _check_command(cfg, tmp_path)
    assert args.train.batch_size == 8192


def test_extra_args_reach_openrlhf(tmp_path):
    cfg = _cfg("qwen3-30b-a3b-gspo")
    assert _check_command(cfg, tmp_path).actor.aux_loss_coef == 0.001


def test_openrlhf_still_refuses_what_its_own_checks_refuse(tmp_path):
    cfg = _cfg("qwen2.5-math-7b-dapo", ["openrlhf.extra_args=[--train.partial_rollout_enable]"])
    with pytest.raises(CLIError, match="partial_rollout_enable requires --train.async_enable"):
        parse(build_command(cfg, tmp_path, "x").openrlhf_argv)


def test_a_cpu_runs_processes_share_its_threads(tmp_path, monkeypatch):
    """OMP_NUM_THREADS of a CPU run's processes: NSR_THREADS split among the processes that compute together (the
    ranks, or the vLLM engines; the loop alternates them), at least 1; a value the caller set wins; none on a GPU."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = "smollm2-openrlhf-cpu"
    for threads, overrides, want in [
        (None, [], "1"),
        ("2", [], "2"),
        ("4", [], "4"),
        ("2", ["openrlhf.gpus_per_node=2", "openrlhf.train_batch_size=0"], "1"),
        ("4", ["openrlhf.vllm_engines=2"], "2"),
    ]:
        if threads is None:
            monkeypatch.delenv("NSR_THREADS", raising=False)
        else:
            monkeypatch.setenv("NSR_THREADS", threads)
        env = build_command(_cfg(cpu, overrides), tmp_path, "r").env
        assert env["OMP_NUM_THREADS"] == want, (threads, overrides)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in build_command(_cfg(cpu), tmp_path, "r").env  # the caller's 3 reaches the run
    monkeypatch.setenv("NSR_THREADS", "two")
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.raises(ConfigError, match="NSR_THREADS='two' is not valid; allowed: a positive integer"):
        build_command(_cfg(cpu), tmp_path, "r")
    assert build_command(_cfg("qwen2.5-math-7b-dapo"), tmp_path, "r").env == {}


def test_a_cpu_runs_thread_count_is_recorded_a_gpu_runs_not():
    """experiments.run records NSR_THREADS in status.json for the backends whose rounding it sets (Backend.threaded):
    an OpenRLHF run on the CPU (its processes take those threads), not one on GPUs (which never reads it)."""
    from experiments.backends import BACKENDS

    assert BACKENDS["openrlhf"].threaded(_cfg("smollm2-openrlhf-cpu")) is True
    assert BACKENDS["openrlhf"].threaded(_cfg("qwen2.5-math-7b-dapo")) is False
    assert BACKENDS["tiny"].threaded(_cfg("tiny")) and BACKENDS["trl"].threaded(_cfg("smollm2-trl-cpu"))
