"""The launcher's wiring against OpenRLHF 0.11.2's real trainer code, on CPU, in a real Ray worker (num_gpus=0).

OpenRLHF's trainer modules import flash-attn, vLLM and DeepSpeed at module top; none runs on CPU, so this module puts
import-only stand-ins on the path for the CUDA-only packages (tests/fixtures/openrlhf/stubs: flash_attn and vllm;
every callable there raises; DeepSpeed is the real one). Then:
* the launcher's install() swaps the actor classes and wraps get_strategy; OpenRLHF's own get_strategy builds the
  strategy from args parsed by OpenRLHF's own parser from a preset's command line;
* a PolicyModelActor created exactly as OpenRLHF's RayActorGroup would (but num_gpus=0) is our subclass in the
  worker and receives ``args.nsr`` inside the pickled strategy (the training step itself, with real DeepSpeed and
  OpenRLHF's Actor, is tests/test_openrlhf_deepspeed.py);
* the controller's advantage interventions on OpenRLHF's real ``compute_advantages_and_returns`` equal
  ``nsr.compute_advantages``, its metrics.jsonl row equals metrics.row_from_logs, and it stops OpenRLHF's real fit
  loop at train.steps.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

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
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "vllm", "_stub")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def ray_session(orl):
    """Workers import nsr from its install (pip install -e .); the stand-ins travel as Ray py_modules, and the
    functions this module sends are pickled by value, so no path is exported."""
    from ray import cloudpickle  # Ray's own copy pickles the tasks

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    stubs = [str(p) for p in sorted(STUBS.iterdir()) if p.is_dir() or p.suffix == ".py"]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"py_modules": stubs},
    )
    yield
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


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


def in_the_worker(actor, strategy):
    """Executed inside the Ray actor (``__ray_call__``): what the worker built from the pickled strategy."""
    from nsr.openrlhf.actors import make_loss

    loss = make_loss(strategy.args, rank=0)
    return {
        "actor_class": f"{type(actor).__module__}.{type(actor).__name__}",
        "nsr": strategy.args.nsr,
        "loss_class": type(loss).__name__,
        "rule": loss.cfg.rule,
        "level": loss.cfg.level,
        "pid": os.getpid(),
    }


def test_install_swaps_openrlhfs_classes_and_strategy_carries_the_config(orl):
    import openrlhf.utils

    args, settings = _args(["loss.rule=nsr", "loss.delta=0.3"])
    orl.launch.install(settings)
    assert orl.ppo_actor.PolicyModelActor.__ray_actor_class__ is orl.actors.NSRPolicyModelActor
    assert orl.ppo_trainer.PPOTrainer.__ray_actor_class__ is orl.actors.NSRPPOTrainer
    assert isinstance(orl.ppo_trainer.PPOTrainer, orl.actors.StopsAtSigterm)  # its actors die at SIGTERM
    assert issubclass(orl.actors.NSRPolicyModelActor, orl.actors.BasePolicyModelActor)
    strategy = openrlhf.utils.get_strategy(args)  # OpenRLHF's DeepspeedStrategy, through our wrapper
    assert type(strategy).__name__ == "DeepspeedStrategy" and strategy.args.nsr is settings
    orl.launch.install(settings)  # idempotent: wraps the original get_strategy, not the wrapper
    assert openrlhf.utils.get_strategy.__wrapped__.__module__ == "openrlhf.utils.utils"


class _Steps:
    """A stand-in controller: counts steps while it lives."""

    def __init__(self):
        self.n = 0

    def step(self):
        self.n += 1
        return self.n


def _dies(actor, within: float = 30.0) -> bool:
    """True once a call to ``actor`` fails because the actor is dead (ray.kill is asynchronous: a call made just after
    it may still run); False if every call within ``within`` seconds succeeds."""
    from ray.exceptions import RayActorError

    end = time.time() + within
    while time.time() < end:
        try:
            ray.get(actor.step.remote(), timeout=within)
        except RayActorError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_kills_the_controller_then_runs_the_handler_before_it(orl, ray_session):
    """The driver at SIGTERM: the controller made through StopsAtSigterm is dead (its next call fails), and the
    handler that was there before (Ray's sys.exit in the launcher; a recorder here) still runs, once."""
    import signal

    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        stops = orl.actors.StopsAtSigterm(ray.remote(num_cpus=0)(_Steps))
        controller = stops.remote()
        named = stops.options(name="nsr-test-controller").remote()  # through .options(...) as well
        other = ray.remote(num_cpus=0)(_Steps).remote()  # made without the wrapper: left alone
        assert ray.get(controller.step.remote()) == 1 and ray.get(named.step.remote()) == 1
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        assert _dies(controller) and _dies(named)
        assert ray.get(other.step.remote()) == 1
        os.kill(os.getpid(), signal.SIGTERM)  # the recorder is back in place, the kill done once
        assert seen == [signal.SIGTERM] * 2
        # with no handler before (the default action): the kill, then the process ends as SIGTERM would end it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        controller = orl.actors.StopsAtSigterm(ray.remote(num_cpus=0)(_Steps)).remote()
        assert ray.get(controller.step.remote()) == 1
        with pytest.raises(SystemExit) as ended:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at once; this is never reached in full
        assert ended.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert _dies(controller)
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("rule", ["nsr", "hard"])
def test_the_ray_worker_builds_our_actor_and_loss_from_the_pickled_strategy(orl, ray_session, rule):
    """The training step itself runs for real (DeepSpeed, OpenRLHF's Actor) in tests/test_openrlhf_deepspeed.py;
    here: in a real Ray worker the actor class is ours and the config arrives inside OpenRLHF's strategy."""
    import openrlhf.utils

    args, settings = _args([f"loss.rule={rule}", "loss.delta=0.3"])
    orl.launch.install(settings)
    strategy = openrlhf.utils.get_strategy(args)
    # as RayActorGroup creates it (launcher.py), minus the GPU
    actor = orl.ppo_actor.PolicyModelActor.options(num_gpus=0).remote(1, 0, None, None)
    out = ray.get(actor.__ray_call__.remote(in_the_worker, strategy), timeout=300)
    ray.kill(actor)
    assert out["pid"] != os.getpid()
    assert out["actor_class"] == "nsr.openrlhf.actors.NSRPolicyModelActor"
    assert out["nsr"] == settings  # the config rode in the pickled strategy
    assert (out["loss_class"], out["rule"], out["level"]) == ("NSRPolicyLoss", rule, "token")


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
    controller.samples_generator = Loader(0)
    controller.install_nsr(args)
    controller._nsr_step = 7
    exps = controller.experience_maker.compute_advantages_and_returns(_experiences(orl, rewards, 4, split=5))
    ours = torch.empty(len(rewards))
    for e in exps:
        assert torch.all(e.advantages[:, :-1] == e.advantages[:, :1])  # constant along the response
        assert torch.all(e.advantages[:, -1] == (0 if settings.advantages.noise_mode == "add" else e.advantages[:, -1]))
        ours[torch.tensor(e.index)] = e.advantages[:, 0]
    want = nsr.compute_advantages(
        torch.tensor(rewards), torch.arange(len(rewards)) // 4, settings.advantages, step_generator(0, 7)
    )
    torch.testing.assert_close(ours, want.float(), rtol=1e-5, atol=1e-6)


def test_controller_writes_one_metrics_row_per_step(orl, tmp_path):
    from nsr.openrlhf.metrics import premise_logs, row_from_logs
    from nsr.premise import counts_row

    args, settings = _args()
    args.nsr = dataclasses.replace(settings, metrics_path=str(tmp_path / "metrics.jsonl"))
    controller = object.__new__(orl.actors.NSRPPOTrainer)
    controller.experience_maker, controller.strategy = _maker(orl, args), SimpleNamespace(args=args)
    controller.samples_generator = Loader(0)
    controller.install_nsr(args)
    controller.args, controller.wandb_logger, controller.tensorboard_logger = args, None, None
    args.ckpt.save_steps = float("inf")  # as PPOTrainer.__init__ sets it when checkpoints are off
    logs = {"policy_loss": 0.5, "rollout/reward_mean": 0.25, "nsr_rescue_frac": 0.01, "generated_samples": ["t", 1]}
    for step in (1, 2):
        controller.save_logs_and_checkpoints(step, logs, {})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one row per step, in order, appended before the checkpoint
    assert (rows[0]["policy_loss"], rows[0]["reward_mean"], rows[0]["rescue_frac"]) == (0.5, 0.25, 0.01)
    assert rows[0]["entropy"] is None and "generated_samples" not in rows[0]  # not logged: null, text dropped
    assert rows[1] == row_from_logs(2, logs)
    assert not (tmp_path / "ratio_bins.jsonl").exists()  # no premise meter in these logs: no row

    # with the actor's premise scalars (token level), one ratio_bins.jsonl row per step next to metrics.jsonl, with
    # the run's delta and executor
    counts = torch.arange(66, dtype=torch.float64).reshape(2, 3, 11)
    logs = {**logs, **premise_logs(counts.tolist(), 500.0)}
    for step in (3, 4):
        controller.save_logs_and_checkpoints(step, logs, {})
    bins = [json.loads(line) for line in (tmp_path / "ratio_bins.jsonl").read_text().splitlines()]
    assert bins == [counts_row(counts, step, controller._nsr_loss, 500) for step in (3, 4)]
    assert (bins[0]["delta"], bins[0]["executor"]) == (settings.loss_config().delta, settings.loss_config().executor)


class Loader:
    """The prompt side of OpenRLHF's SamplesGenerator (vLLM generation cannot run on CPU): ``batches`` rollouts,
    then exhausted, as ``generate_samples`` reports it; a dataloader state that counts the batches drawn."""

    def __init__(self, batches):
        self.batches, self.drawn = batches, 0

    def generate_samples(self, **kwargs):
        self.drawn += 1
        return [f"rollout{self.drawn}"], None, 1, self.drawn >= self.batches

    def __len__(self):
        return self.batches

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = state["drawn"]


def _controller(orl, args, batches, resumed_at=0):
    """An NSRPPOTrainer whose fit is OpenRLHF's real PPOTrainer.fit loop; below NSRPPOTrainer.train_step and
    save_logs_and_checkpoints, the GPU work (experience making, PPO update, vLLM sync, DeepSpeed save) is recorded
    instead of done."""

    class Recorded(orl.actors.BasePPOTrainer):
        def train_step(self, rollout_samples, global_step):
            self.trained.append((global_step + 1, rollout_samples[0]))
            return {"policy_loss": 0.0}, global_step + 1

        def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
            self.saved.append(global_step)

        def init_checkpoint_states(self):
            base = {"episode": 0, "total_consumed_prompts": resumed_at, "best_eval_metric_key": None}
            return {**base, "global_step": resumed_at, "data_loader_state_dict": {"drawn": resumed_at}}

        def broadcast_to_vllm(self):
            pass

    Trainer = type("Trainer", (orl.actors.NSRPPOTrainer, Recorded), {})  # MRO: NSR layer, then the recorder
    t = object.__new__(Trainer)
    loader = Loader(batches)
    t.args, t.strategy, t.trained, t.saved = args, SimpleNamespace(args=args), [], []
    t.experience_maker, t.samples_generator, t.prompts_dataloader = _maker(orl, args), loader, loader
    t.eval_dataloader, t.wandb_logger, t.tensorboard_logger, t.generate_kwargs = None, None, None, {}
    t.install_nsr(args)
    return t


@pytest.mark.parametrize("resumed_at", [0, 2])
def test_every_arm_stops_at_train_steps_whatever_data_is_left(orl, resumed_at):
    """With dynamic filtering the loader holds 3x the prompts a run needs; OpenRLHF's fit runs until they are gone
    (an arm-dependent step). --nsr.max_steps stops OpenRLHF's own loop at train.steps, also after a resume."""
    args, settings = _args(["train.steps=5"])
    assert settings.max_steps == 5
    args.nsr = settings
    t = _controller(orl, args, batches=12, resumed_at=resumed_at)
    t.fit()
    assert [s for s, _ in t.trained] == list(range(resumed_at + 1, 6)) and t.saved == list(range(resumed_at + 1, 6))
    assert t.trained[0][1] == f"rollout{resumed_at + 1}"  # the loader continued where the checkpoint left it
    uncapped = dataclasses.replace(settings, max_steps=0)  # what OpenRLHF alone does: all 12 batches
    args.nsr = uncapped
    t = _controller(orl, args, batches=12)
    t.fit()
    assert [s for s, _ in t.trained] == list(range(1, 13))
