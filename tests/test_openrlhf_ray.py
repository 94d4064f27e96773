"""The launcher's wiring against OpenRLHF 0.11.2's real trainer code, on CPU, in a real Ray worker (num_gpus=0).

OpenRLHF's trainer modules import flash-attn, vLLM and DeepSpeed at module top; none runs on CPU, so this module puts
import-only stand-ins on the path (tests/fixtures/openrlhf/stubs: every callable there raises). Then:
* the launcher's install() swaps the actor classes and wraps get_strategy; OpenRLHF's own get_strategy builds the
  strategy from args parsed by OpenRLHF's own parser from a preset's command line;
* a PolicyModelActor created exactly as OpenRLHF's RayActorGroup would (but num_gpus=0) is our subclass in the
  worker, receives ``args.nsr`` inside the pickled strategy, installs NSRPolicyLoss into a real ActorPPOTrainer, and
  OpenRLHF's real ``training_step`` (on a tiny CPU model; DeepSpeed's backward/step replaced by plain torch) logs
  our ``nsr_*`` metrics;
* the controller's advantage interventions on OpenRLHF's real ``compute_advantages_and_returns`` equal
  ``nsr.compute_advantages``, and its metrics.jsonl row equals metrics.row_from_logs.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "tests" / "fixtures" / "openrlhf" / "stubs"

ray = pytest.importorskip("ray", reason="ray==2.55.0 (requirements-cpu.txt) is needed for the actor tests")


@pytest.fixture(scope="module")
def orl():
    """OpenRLHF's trainer modules (imported with the stubs) and the launcher, installed once."""
    sys.path.insert(0, str(STUBS))
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import ppo_actor

    from nsr.openrlhf import actors, launch

    yield SimpleNamespace(ppo_actor=ppo_actor, ppo_trainer=ppo_trainer, actors=actors, launch=launch)
    sys.path.remove(str(STUBS))  # later test modules must not find the stand-ins
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "vllm", "deepspeed", "_stub")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def ray_session(orl):
    # Workers inherit the driver's environment: the stubs, the repo and this folder (for the functions sent below).
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(ROOT), str(ROOT / "tests")] + ([old] if old else []))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def _args(overrides=()):
    """OpenRLHF's args for a cluster preset's command line (OpenRLHF's own parser and checks), and the settings."""
    from experiments.config import load_config
    from experiments.openrlhf.argv import build_command
    from nsr.openrlhf.cli import parse
    from nsr.openrlhf.settings import NSRSettings

    cfg = load_config(ROOT / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml", list(overrides))
    cmd = build_command(cfg, "/tmp/nsr-test-run", "run-x")
    settings, rest = NSRSettings.parse(cmd.nsr_argv + cmd.openrlhf_argv)
    return parse(rest), settings


class TinyActor(torch.nn.Module):
    """The interface ActorPPOTrainer.training_step calls on openrlhf.models.Actor, on a 2-layer CPU model."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=g))

    def forward(self, sequences, action_mask, attention_mask=None, return_output=False, return_entropy=False, **kw):
        logits = self.emb[sequences] @ self.out  # (B, T, V)
        logp = logits[:, :-1].log_softmax(-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
        A = action_mask.shape[1]
        out = SimpleNamespace(entropy=-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1), aux_loss=None)
        return (logp[:, -A:], out) if return_output else logp[:, -A:]


class CPUStrategy:
    """DeepSpeed's part of the strategy (backward, optimizer step, grad norm), in plain torch."""

    def __init__(self, strategy):
        self.args, self.ring_attn_group = strategy.args, None

    def backward(self, loss, model, optim):
        loss.backward()

    def optimizer_step(self, optim, model, scheduler, name="actor"):
        optim.step()
        optim.zero_grad()
        scheduler.step()

    def get_grad_norm(self, model):
        return 0.0


def run_training_step(actor, strategy, checkpoint_states):
    """Executed inside the Ray actor (``__ray_call__``): a real ActorPPOTrainer's training_step after install_nsr."""
    from openrlhf.models import PolicyLoss
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    from nsr.openrlhf.actors import policy_loss_kwargs

    args = strategy.args
    trainer = object.__new__(ActorPPOTrainer)  # __init__ needs NCCL; these are the attributes training_step reads
    model = TinyActor()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.args, trainer.strategy, trainer.actor, trainer.actor_optim = args, CPUStrategy(strategy), model, optim
    trainer.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    trainer.ema_model, trainer.aux_loss, trainer.replay_buffer = None, False, None
    trainer.actor_loss_fn = PolicyLoss(**policy_loss_kwargs(args))  # what OpenRLHF installed
    installed = actor.install_nsr(args, trainer, checkpoint_states)
    actor.fit_step = actor._nsr_rl_step

    g = torch.Generator().manual_seed(1)
    B, T, A = 6, 12, 8
    seq = torch.randint(0, 11, (B, T), generator=g)
    mask = torch.arange(A)[None] < torch.tensor([8, 8, 5, 7, 3, 8])[:, None]
    with torch.no_grad():
        old = model(seq, mask) + 0.5 * torch.randn(B, A, generator=g)  # a stale policy: ratios far from 1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None].expand(B, A) * mask
    exp = Experience(sequences=seq, attention_mask=torch.ones_like(seq), action_mask=mask, action_log_probs=old)
    exp.advantages, exp.info = adv, {}
    status = trainer.training_step(exp, 0.0, 0, {"dp_size": 1, "batch_num_tokens": float(mask.sum())})
    metrics = {k: float(torch.as_tensor(v).float().mean()) for k, v in status["metrics"].items()}
    return {
        "installed": installed,
        "actor_class": f"{type(actor).__module__}.{type(actor).__name__}",
        "loss_class": type(trainer.actor_loss_fn).__name__,
        "nsr": args.nsr,
        "rl_step": actor._nsr_rl_step,
        "metrics": metrics,
        "pid": os.getpid(),
    }


def test_install_swaps_openrlhfs_classes_and_strategy_carries_the_config(orl):
    import openrlhf.utils

    args, settings = _args(["loss.rule=nsr", "loss.delta=0.3"])
    orl.launch.install(settings)
    assert orl.ppo_actor.PolicyModelActor.__ray_actor_class__ is orl.actors.NSRPolicyModelActor
    assert orl.ppo_trainer.PPOTrainer.__ray_actor_class__ is orl.actors.NSRPPOTrainer
    assert issubclass(orl.actors.NSRPolicyModelActor, orl.actors.BasePolicyModelActor)
    strategy = openrlhf.utils.get_strategy(args)  # OpenRLHF's DeepspeedStrategy, through our wrapper
    assert type(strategy).__name__ == "DeepspeedStrategy" and strategy.args.nsr is settings
    orl.launch.install(settings)  # idempotent: wraps the original get_strategy, not the wrapper
    assert openrlhf.utils.get_strategy.__wrapped__.__module__ == "openrlhf.utils.utils"


@pytest.mark.parametrize("rule", ["nsr", "hard"])
def test_actor_in_a_ray_worker_runs_nsr_inside_openrlhfs_training_step(orl, ray_session, rule):
    import openrlhf.utils

    args, settings = _args([f"loss.rule={rule}", "loss.delta=0.3"])
    orl.launch.install(settings)
    strategy = openrlhf.utils.get_strategy(args)
    # as RayActorGroup creates it (launcher.py), minus the GPU
    actor = orl.ppo_actor.PolicyModelActor.options(num_gpus=0).remote(1, 0, None, None)
    out = ray.get(actor.__ray_call__.remote(run_training_step, strategy, {"global_step": 4}), timeout=300)
    ray.kill(actor)
    assert out["pid"] != os.getpid()
    assert out["actor_class"] == "nsr.openrlhf.actors.NSRPolicyModelActor"
    assert out["loss_class"] == "NSRPolicyLoss" and out["installed"]["rule"] == rule
    assert out["nsr"] == settings  # the config rode in the pickled strategy
    assert out["rl_step"] == 4  # resumed at global_step 4: the streams continue there
    m = out["metrics"]
    assert {"nsr_clip_frac_low", "nsr_clip_frac_high", "nsr_rescue_frac", "nsr_pushout_frac"} <= set(m)
    assert m["nsr_clip_frac_low"] + m["nsr_clip_frac_high"] == pytest.approx(m["ppo_clip_ratio"], abs=1e-6)
    assert m["ppo_clip_ratio"] > 0
    assert (m["nsr_rescue_frac"] > 0) == (rule == "nsr")
    assert "entropy_loss" in m and "policy_loss" in m  # entropy_coef 0 still logs entropy


def _experiences(orl, rewards, n_samples, split):
    """OpenRLHF Experiences for a rollout in a shuffled micro-batch split (index = original sample order)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    N, A = len(rewards), 5
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3)).tolist()
    out = []
    for chunk in (perm[i : i + split] for i in range(0, N, split)):
        mask = torch.ones(len(chunk), A, dtype=torch.bool)
        mask[:, -1] = False  # a padded last token
        e = Experience(action_mask=mask, rewards=torch.tensor([rewards[i] for i in chunk]), index=list(chunk))
        e.kl = torch.zeros(len(chunk), A)
        out.append(e)
    return out


def _maker(orl, args):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    maker = object.__new__(RemoteExperienceMaker)  # __init__ takes the Ray actor groups; these are what it reads
    maker.strategy, maker.args = SimpleNamespace(args=args), args
    maker.advantage_estimator, maker.kl_ctl = args.algo.advantage.estimator, FixedKLController(0.0)
    return maker


@pytest.mark.parametrize(
    "overrides",
    [
        ["advantages.kind=random_reward"],
        ["advantages.kind=positive_only", "advantages.noise=0.3"],
        ["advantages.kind=group_norm", "advantages.noise=0.5", "advantages.noise_mode=add"],
        ["advantages.kind=no_std", "advantages.noise=0.2"],
    ],
)
def test_controller_advantages_equal_nsr_compute_advantages(orl, overrides, tmp_path):
    import nsr
    from nsr.openrlhf.interventions import step_generator

    args, settings = _args(["openrlhf.dynamic_filtering=false", "openrlhf.overlong_buffer_len=0", *overrides])
    args.nsr = settings
    args.rollout.n_samples_per_prompt = 4
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    controller = object.__new__(orl.actors.NSRPPOTrainer)
    controller.experience_maker, controller.strategy = _maker(orl, args), SimpleNamespace(args=args)
    controller.install_nsr(args)
    controller._nsr_step = 7
    exps = controller.experience_maker.compute_advantages_and_returns(_experiences(orl, rewards, 4, split=5))
    ours = torch.empty(len(rewards))
    for e in exps:
        assert torch.all(e.advantages[:, :-1] == e.advantages[:, :1])  # constant along the response
        assert torch.all(e.advantages[:, -1] == (0 if settings.adv_noise_mode == "add" else e.advantages[:, -1]))
        ours[torch.tensor(e.index)] = e.advantages[:, 0]
    want = nsr.compute_advantages(
        torch.tensor(rewards), torch.arange(len(rewards)) // 4, settings.advantage_config(), step_generator(0, 7)
    )
    torch.testing.assert_close(ours, want.float(), rtol=1e-5, atol=1e-6)


def test_controller_writes_one_metrics_row_per_step(orl, tmp_path):
    from experiments.openrlhf.metrics import row_from_logs

    args, settings = _args()
    args.nsr = settings.__class__(**{**vars(settings), "metrics_path": str(tmp_path / "metrics.jsonl")})
    controller = object.__new__(orl.actors.NSRPPOTrainer)
    controller.experience_maker, controller.strategy = _maker(orl, args), SimpleNamespace(args=args)
    controller.install_nsr(args)
    controller.args, controller.wandb_logger, controller.tensorboard_logger = args, None, None
    args.ckpt.save_steps = float("inf")  # as PPOTrainer.__init__ sets it when checkpoints are off
    logs = {"policy_loss": 0.5, "rollout/reward_mean": 0.25, "nsr_rescue_frac": 0.01, "generated_samples": ["t", 1]}
    for step in (1, 2):
        controller.save_logs_and_checkpoints(step, logs, {})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [row_from_logs(1, logs), row_from_logs(2, logs)]
