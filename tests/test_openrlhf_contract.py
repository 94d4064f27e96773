"""Contract with the installed OpenRLHF 0.11.2: every signature, import line and call the NSR layer relies on.

Read from the installed source with ``ast`` (no import, no GPU). When OpenRLHF changes one of these, this file fails
and names what moved; nsr/openrlhf/ (loss.py, actors.py, launch.py, cli.py) is then to be checked against it.
"""

import ast
import inspect

import pytest

from nsr.openrlhf.loss import NSRPolicyLoss, PolicyLoss
from nsr.openrlhf.reference import SUPPORTED_VERSION, installed_version, openrlhf_root


def _tree(*parts):
    path = openrlhf_root().joinpath(*parts)
    return ast.parse(path.read_text(), filename=str(path))


def _find(tree, qualname):
    """The FunctionDef/ClassDef at ``Class.method`` or ``function``."""
    node = tree
    for name in qualname.split("."):
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        assert node is not None, f"{qualname} is gone"
    return node


def _src(node) -> str:
    return ast.unparse(node)


def _top_imports(tree) -> set[str]:
    return {_src(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_version():
    assert installed_version() == SUPPORTED_VERSION


def test_policy_loss_signatures_match():
    ours = [p for p in _params(NSRPolicyLoss.__init__) if p[0] not in ("settings", "seed", "rank")]
    assert ours == _params(PolicyLoss.__init__)
    params = inspect.signature(NSRPolicyLoss.__init__).parameters.values()
    kw_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert kw_only == ["settings", "seed", "rank"]  # callers of PolicyLoss(...) are unaffected
    assert _params(NSRPolicyLoss.forward) == _params(PolicyLoss.forward)


def test_ppo_actor_builds_and_calls_the_loss_as_we_do():
    tree = _tree("trainer", "ray", "ppo_actor.py")
    assert "from openrlhf.models import Actor, PolicyLoss, aggregate_loss" in _top_imports(tree)
    init = _find(tree, "ActorPPOTrainer.__init__")
    calls = [
        n.value
        for n in ast.walk(init)
        if isinstance(n, ast.Assign) and _src(n.targets[0]) == "self.actor_loss_fn" and isinstance(n.value, ast.Call)
    ]
    assert len(calls) == 1 and _src(calls[0].func) == "PolicyLoss" and not calls[0].args
    theirs = {k.arg: _src(k.value).replace("self.args.", "args.") for k in calls[0].keywords}
    ours = {k.arg: _src(k.value) for k in _find(_tree_of_actors(), "policy_loss_kwargs").body[-1].value.keywords}
    assert ours == theirs  # nsr.openrlhf.actors.policy_loss_kwargs builds NSRPolicyLoss with the same arguments

    step = _find(tree, "ActorPPOTrainer.training_step")
    assert [a.arg for a in step.args.args] == ["self", "experience", "kl_ctl", "step", "loss_batch_info"]
    body = _src(step)
    assert "actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = self.actor_loss_fn(" in body
    loss_at = body.index("self.actor_loss_fn(")
    assert body.index("for k, v in experience.info.items():") > loss_at  # info written by the loss is logged
    assert "self.training_step(experience, kl_ctl, step, loss_batch_info)" in _src(
        _find(tree, "ActorPPOTrainer.ppo_train")
    )

    actor = _find(tree, "PolicyModelActor")
    assert [_src(d) for d in actor.decorator_list] == ["ray.remote(num_gpus=1)"]
    init_model = _find(tree, "PolicyModelActor.init_model_from_pretrained")
    assert [a.arg for a in init_model.args.args] == ["self", "strategy", "pretrain", "max_steps", "vllm_engines"]
    src = _src(init_model)
    assert "self.trainer = ActorPPOTrainer(" in src and "self.checkpoint_states = states" in src
    fit = _find(tree, "PolicyModelActor.fit")
    assert [a.arg for a in fit.args.args] == ["self", "kl_ctl"] and "self.trainer.ppo_train(kl_ctl)" in _src(fit)


def _tree_of_actors():
    import nsr.openrlhf

    path = next(iter(nsr.openrlhf.__path__)) + "/actors.py"
    with open(path) as f:
        return ast.parse(f.read())


def test_cli_picks_up_our_classes_and_strategy():
    tree = _tree("cli", "train_ppo_ray.py")
    top = _top_imports(tree)
    assert "from openrlhf.trainer.ray.ppo_actor import PolicyModelActor" in top  # read after actors.install()
    assert "from openrlhf.utils import get_strategy" in top  # read after launch.install() wraps it
    train = _src(_find(tree, "train"))
    assert "from openrlhf.trainer.ppo_trainer import PPOTrainer" in train  # imported at call time
    assert "strategy = get_strategy(args)" in train
    # the controller is made with .remote (actors.StopsAtSigterm wraps that call: the actor it kills at SIGTERM)
    assert "PolicyModelActor," in train and "ppo_trainer = PPOTrainer.remote(" in train
    assert "if not ray.is_initialized():" in train


def test_controller_hooks_exist():
    tree = _tree("trainer", "ppo_trainer.py")
    assert [_src(d) for d in _find(tree, "PPOTrainer").decorator_list] == ["ray.remote"]
    assert [a.arg for a in _find(tree, "BasePPOTrainer.train_step").args.args] == [
        "self",
        "rollout_samples",
        "global_step",
    ]
    save = _find(tree, "BasePPOTrainer.save_logs_and_checkpoints")
    assert [a.arg for a in save.args.args] == ["self", "global_step", "logs_dict", "client_states"]
    fit = _src(_find(tree, "PPOTrainer.fit"))
    assert "status, global_step = self.train_step(rollout_samples, global_step)" in fit
    assert "self.save_logs_and_checkpoints(global_step, status, client_states)" in fit
    assert "self.experience_maker = RemoteExperienceMaker(" in _src(_find(tree, "BasePPOTrainer.__init__"))
    maker = _tree("trainer", "ppo_utils", "experience_maker.py")
    make = _src(_find(maker, "RemoteExperienceMaker.make_experience_batch"))
    assert "experiences = self.compute_advantages_and_returns(experiences)" in make
    adv = _src(_find(maker, "RemoteExperienceMaker.compute_advantages_and_returns"))
    assert "rewards = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-09)" in adv
    assert "experience.index" in adv  # the original sample order the interventions rely on


@pytest.mark.parametrize("flag", ["--actor.eps_clip_low_high", "--actor.loss_agg_mode", "--actor.policy_loss_type"])
def test_flags_the_argv_builder_relies_on(flag):
    from nsr.openrlhf.cli import build_parser

    assert flag in build_parser()._option_string_actions
