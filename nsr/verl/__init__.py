"""NSR for verl users: every rule of ``nsr.RULES`` as a verl 0.9.1 policy-loss mode ``nsr:<rule>``.

Two lines added to a verl DAPO recipe (the method library installed, ``pip install "./nsr[verl]"``, in the
environment of every Ray worker) run NSR:

    actor_rollout_ref.actor.policy_loss._target_=nsr.verl.NSRPolicyLossConfig \\
    actor_rollout_ref.actor.policy_loss.loss_mode=nsr:nsr \\

Optional parameters take hydra's ``+`` (keys verl's own config does not have):
``+actor_rollout_ref.actor.policy_loss.delta=0.2``, ``+...policy_loss.executor=clean``, ``+...policy_loss.seed=0``,
``+...policy_loss.dual_clip=false``; the trust region stays ``actor.clip_ratio_low`` / ``clip_ratio_high``.
The kit's ``python -m experiments.verl_overrides --sweep sweeps/delta.yaml`` prints the overrides of every grid
point of a sweep. Importing this package registers the modes (:func:`register`); details in :mod:`nsr.verl.plugin`.
A rule that needs stale ratios is refused by verl's own config validation when the schedule has one update per step
(``ppo_epochs`` 1, ``ppo_mini_batch_size`` = ``data.train_batch_size``): :func:`check_schedule`.
"""

from nsr.verl.plugin import (
    PREFIX,
    VERL_VERSION,
    NSRPolicyLossConfig,
    check_schedule,
    loss_config,
    loss_modes,
    policy_loss,
    recipe_overrides,
    register,
)

register()

__all__ = [
    "PREFIX",
    "VERL_VERSION",
    "NSRPolicyLossConfig",
    "check_schedule",
    "loss_config",
    "loss_modes",
    "policy_loss",
    "recipe_overrides",
    "register",
]
