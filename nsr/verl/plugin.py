"""Every rule of ``nsr.RULES`` as a verl 0.9.1 policy-loss mode ``nsr:<rule>`` (docs/design.md, "Backends").

verl selects the actor's policy loss by name from ``core_algos.POLICY_LOSS_REGISTRY``
(``actor_rollout_ref.actor.policy_loss.loss_mode``) and calls it as

    loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (pg_loss scalar, metrics dict)

with ``config`` the actor's ``ActorConfig``. Each mode here computes the per-token loss with ``nsr.policy_loss``,
weights it by verl's rollout-correction weights when given, and reduces it with verl's own ``agg_loss`` (so every
verl aggregation mode and its global-batch normalisation across micro-batches and DP ranks are verl's).

Parameters. verl's ``PolicyLossConfig`` is a structured dataclass (an unknown key fails), so the rule's own
parameters live in the subclass :class:`NSRPolicyLossConfig`, selected with ``policy_loss._target_``; the trust
region, dual clip constant and SAPO temperatures are read from verl's own actor keys (``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``, ``tau_neg``), so a DAPO recipe keeps its values. With verl's
plain ``PolicyLossConfig`` the rule runs with the defaults of the subclass.

Registration reaches every process that builds the actor config: hydra imports the ``_target_`` module
(``nsr.verl``) when verl's worker turns the config into dataclasses, and importing ``nsr.verl`` registers the modes.
``VERL_USE_EXTERNAL_MODULES=nsr.verl`` (read by ``import verl`` in every process) does the same without ``_target_``.
Rules added to ``nsr.RULES`` later become modes the same way: :func:`register` walks the registry when called.

Large ratios: ``nsr.policy_loss`` clamps log r at +-``nsr.LOG_RATIO_CLAMP`` (20) as verl's token-level modes
(vanilla, sapo, cispo) do, so ``nsr:hard`` equals ``vanilla`` at any ratio (tests/test_verl.py pins |log r| = 50).
verl's gspo clamps its sequence log-ratio at +10 instead; ``nsr:<rule>`` at level sequence keeps the +-20 clamp.

Metrics, under verl's names where the meaning is the same: ``actor/pg_clipfrac`` (tokens the trust region clipped,
either side), ``actor/ppo_kl`` (mean of old - new log-prob, with verl's clamp: +-20 at token level as vanilla,
unclamped at sequence level as gspo), ``actor/pg_clipfrac_lower`` (verl's meaning: the dual-clip fraction, A < 0 and
r > clip_ratio_c); and every ``nsr.METRIC_KEYS`` value as ``actor/nsr_<key>`` (``actor/nsr_approx_kl`` unclamped).
Values are detached 0-dim tensors (verl's ``Metric`` turns them into floats when it aggregates).

The premise meter (token level; ``policy_loss.premise``, default on): per micro-batch, ``actor/premise/<key>`` for
every ``nsr.premise.RATE_KEYS`` key: per advantage side the clipped tokens within NSR's rescue zone
(``pos_clipped_zone``, the in-zone clipped mass per token) and deeper (``pos_clipped_deep``), the clipped tokens the
rule still gave a gradient (``pos_rescued``) and the sum of their gradient weight (``pos_weight``), each divided by
the micro-batch's valid tokens; and the counts themselves, ``actor/premise/n_<side>_clipped_zone``,
``n_<side>_clipped_deep``, ``n_tokens`` and ``n_tokens_adv`` (valid tokens with a nonzero advantage), so a step's mean
count over its mean token count is its exact pooled rate. verl wraps a loss's metrics as
``Metric(aggregation=mean)``: the mean over the
micro-batches of a rank, then over the ranks, all with equal weight. Rates per token are the quantities whose equal-
weight mean stays a per-token rate (counts would scale with the micro-batch size; a share of clipped tokens would
weigh a micro-batch with 1 clipped token like one with 100); the mean equals the step's pooled rate when the
micro-batches hold equal token counts (``use_dynamic_bsz`` makes them close). Reach (the share of clipped tokens
within the zone) is read from them as zone / (zone + deep), after the averaging (``python -m analysis.premise
--verl``). Each is read to the host by verl's ``Metric`` (one ``.item()`` per metric and micro-batch, as for verl's
own metrics); the counting itself has no host sync.
"""

from __future__ import annotations

import typing
from dataclasses import field, fields, make_dataclass
from typing import Optional

import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import PolicyLossConfig

import nsr
from nsr.premise import premise_counts, rates, token_ratio
from nsr.seeds import generator

PREFIX = "nsr:"
"""Loss modes are ``nsr:<rule>``: verl's own names are identifiers, so none of them can start with this."""
VERL_VERSION = "0.9.1"
"""The verl release this plug-in is written and tested against (tests/test_verl_contract.py)."""


_VERL_KEYS = {
    "eps_low": "clip_ratio_low",
    "eps_high": "clip_ratio_high",
    "dual_clip": "clip_ratio_c",
    "sapo_tau_pos": "tau_pos",
    "sapo_tau_neg": "tau_neg",
}
"""nsr.LossConfig fields read from verl's actor section, by their verl key (dual clip: see NSRPolicyLossConfig)."""
LOSS_KEYS = tuple(f.name for f in fields(nsr.LossConfig) if f.name not in ("rule", *_VERL_KEYS))
"""Every other nsr.LossConfig field (level, delta, executor, ...; fields added later too): a field of
NSRPolicyLossConfig with the same name, default and meaning."""


def _omegaconf_type(tp):
    """The type OmegaConf's structured configs accept for a LossConfig field type: Literal[...] -> str,
    X | None -> Optional[X]."""
    if typing.get_origin(tp) is typing.Literal:
        return str
    args = typing.get_args(tp)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return Optional[_omegaconf_type(inner)]  # noqa: UP045 (OmegaConf reads Optional, not X | None)
    return tp


def _post_init(self):
    if self.loss_mode.startswith(PREFIX):  # check the rule and its parameters before any work starts
        loss_config(self.loss_mode.removeprefix(PREFIX), None, self)


_HINTS = typing.get_type_hints(nsr.LossConfig)
NSRPolicyLossConfig = make_dataclass(
    "NSRPolicyLossConfig",
    [
        *(
            (f.name, _omegaconf_type(_HINTS[f.name]), field(default=f.default))
            for f in fields(nsr.LossConfig)
            if f.name in LOSS_KEYS
        ),  # fmt: skip
        ("dual_clip", bool, field(default=True)),
        ("seed", Optional[int], field(default=None)),  # noqa: UP045
        ("premise", bool, field(default=True)),
        ("allow_on_policy", bool, field(default=False)),
    ],
    bases=(PolicyLossConfig,),
    namespace={"__post_init__": _post_init},
)
NSRPolicyLossConfig.__module__ = __name__
NSRPolicyLossConfig.__doc__ = """verl's ``PolicyLossConfig`` plus the parameters of the nsr rules: a field for every
nsr.LossConfig field that verl's actor section does not hold (LOSS_KEYS: level, delta, executor, ratio_noise, ...;
built from nsr.LossConfig, so fields added there later travel too), and

* ``dual_clip`` (bool, default True): apply verl's dual clip (A < 0 and r > actor.clip_ratio_c), as verl's vanilla
  mode always does (token level only);
* ``seed`` (int or None): seed of the rule's random draws, one stream per process (seed, DP rank); None: torch's
  global RNG;
* ``premise`` (bool, default True): log the premise meter's per-token rates (token level; module docstring);
* ``allow_on_policy`` (bool, default False): let a rule that needs stale ratios run in a schedule with one update per
  step (:func:`check_schedule`), which is refused by default.

Select it in a recipe with ``actor_rollout_ref.actor.policy_loss._target_=nsr.verl.NSRPolicyLossConfig``; set a
parameter with ``+actor_rollout_ref.actor.policy_loss.delta=0.1`` (``+``: a key verl's own config does not have).
"""


def loss_config(rule: str, actor_config=None, policy_loss=None) -> nsr.LossConfig:
    """The ``nsr.LossConfig`` of ``rule`` from verl's actor config (trust region, dual clip, SAPO temperatures) and
    its ``policy_loss`` section (an :class:`NSRPolicyLossConfig`, or verl's plain one: defaults).

    Raises ValueError naming the verl key and the allowed values.
    """
    if policy_loss is None:
        policy_loss = actor_config.policy_loss if actor_config is not None else NSRPolicyLossConfig()
    defaults = {f.name: f.default for f in fields(NSRPolicyLossConfig)}
    kwargs = {k: policy_loss.get(k, defaults[k]) for k in LOSS_KEYS}
    if actor_config is not None:
        kwargs.update(
            {ours: actor_config.get(verl_key) for ours, verl_key in _VERL_KEYS.items() if ours != "dual_clip"}
        )
        # verl's vanilla always applies its dual clip (token level); GSPO recipes have none
        if policy_loss.get("dual_clip", True) and kwargs["level"] == "token":
            kwargs["dual_clip"] = actor_config.get("clip_ratio_c", 3.0)
    try:
        return nsr.LossConfig(rule=rule, **kwargs)
    except ValueError as e:
        msg = str(e).replace("LossConfig.rule='", f"policy_loss.loss_mode='{PREFIX}")
        for ours, verl_key in _VERL_KEYS.items():
            msg = msg.replace(f"LossConfig.{ours}=", f"{verl_key}=")
        raise ValueError("verl actor_rollout_ref.actor." + msg.replace("LossConfig.", "policy_loss.")) from None


_GENERATORS: dict[tuple[int, int, str], torch.Generator] = {}


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """One generator per (seed, DP rank, device) for this process's lifetime, seeded by ``nsr.seeds`` from
    ("verl-loss", seed, rank); None when no seed is set."""
    if seed is None:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    key = (seed, rank, str(device))
    if key not in _GENERATORS:
        _GENERATORS[key] = generator("verl-loss", seed, rank, device=device)
    return _GENERATORS[key]


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """verl's clamped log-ratio (vanilla, sapo, cispo, dppo: clamp(log_prob - old_log_prob, -20, 20)), detached."""
    return (log_prob - old_log_prob).detach().clamp(-nsr.LOG_RATIO_CLAMP, nsr.LOG_RATIO_CLAMP)


def policy_loss(
    rule: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's policy-loss signature for nsr rule ``rule``; ``config`` is verl's ActorConfig.

    Shapes: every tensor (B, T) (response tokens); ``response_mask`` bool or 0/1.
    Returns (scalar loss from verl's ``agg_loss``, metrics of 0-dim tensors).
    """
    if config is None:
        raise ValueError(f"loss mode {PREFIX}{rule} needs verl's actor config (config=None)")
    cfg = loss_config(rule, config)
    mask = response_mask.bool()
    gen = _generator(config.policy_loss.get("seed"), log_prob.device)
    loss_tok, met = nsr.policy_loss(log_prob, old_log_prob, advantages, mask, cfg, generator=gen)
    loss_tok_rule = loss_tok  # the rule's own loss, for the premise meter (before verl's rollout weights)
    if rollout_is_weights is not None:
        loss_tok = loss_tok * rollout_is_weights
    pg_loss = core_algos.agg_loss(
        loss_mat=loss_tok, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    with torch.no_grad():
        log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
        valid = mask.sum().clamp(min=1)
        if cfg.dual_clip is not None:  # verl's pg_clipfrac_lower: the dual-clip fraction
            dual_frac = ((advantages < 0) & (log_ratio.exp() > cfg.dual_clip) & mask).sum() / valid
        else:
            dual_frac = torch.zeros((), device=log_prob.device)
        # verl's ppo_kl: the masked mean of -log r, clamped as verl's token-level modes clamp it; verl's gspo (the
        # sequence-level mode) leaves it unclamped, which is nsr's approx_kl
        ppo_kl = -torch.where(mask, log_ratio, 0.0).sum() / valid if cfg.level == "token" else met["approx_kl"]
    metrics = {
        "actor/pg_clipfrac": met["clip_frac"].detach(),
        "actor/ppo_kl": ppo_kl.detach().to(met["approx_kl"].dtype),
        "actor/pg_clipfrac_lower": dual_frac.to(met["clip_frac"].dtype),
        **{f"actor/nsr_{k}": v.detach() for k, v in met.items()},
    }
    if cfg.level == "token" and config.policy_loss.get("premise", True) and log_prob.requires_grad:
        metrics.update(premise_metrics(loss_tok_rule, log_prob, old_log_prob, advantages, mask, cfg))
    return pg_loss, metrics


PREMISE_PREFIX = "actor/premise/"
"""verl metric names of the premise meter: ``actor/premise/<key>`` for every ``nsr.premise.RATE_KEYS`` key, and
``actor/premise/n_<key>`` for every :data:`PREMISE_COUNT_KEYS` key."""
PREMISE_COUNT_KEYS = ("tokens", "tokens_adv", "pos_clipped_zone", "pos_clipped_deep", "neg_clipped_zone",
                      "neg_clipped_deep")  # fmt: skip
"""The micro-batch counts logged next to the rates: valid tokens, those with a nonzero advantage, and per side the
clipped tokens within the rescue zone and deeper."""


def premise_metrics(loss_tok, log_prob, old_log_prob, advantages, mask, cfg: nsr.LossConfig) -> dict:
    """The premise meter of one micro-batch as per-token rates (0-dim tensors, no host read here): its counts
    (nsr.premise.premise_counts, the gradient of the rule's own per-token loss) over the micro-batch's valid tokens.
    verl averages each over micro-batches and ranks with equal weights, so the logged value is the mean per-token
    rate, equal to the step's pooled rate when micro-batches hold equal token counts (module docstring)."""
    (grad,) = torch.autograd.grad(loss_tok.sum(), log_prob, retain_graph=True)  # d loss_t / d log pi_t
    counts = premise_counts(grad, token_ratio(log_prob, old_log_prob), advantages, mask, cfg)
    out = {PREMISE_PREFIX + k: v for k, v in rates(counts, mask.sum()).items()}
    # counts too (verl means them over micro-batches: a step's mean count over its mean token count is its pooled rate)
    n = {"tokens": mask.sum().double(), "tokens_adv": (mask & (advantages != 0)).sum().double()}
    for i, side in enumerate(("pos", "neg")):
        n[f"{side}_clipped_zone"], n[f"{side}_clipped_deep"] = counts[i, 0, :-1].sum(), counts[i, 0, -1]
    return out | {f"{PREMISE_PREFIX}n_{k}": n[k] for k in PREMISE_COUNT_KEYS}


def make_policy_loss(rule: str):
    """verl's policy-loss function of ``rule`` (a named function, as verl's registered losses are)."""

    def compute_policy_loss_nsr(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
        rollout_is_weights=None,
    ):  # fmt: skip
        return policy_loss(
            rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    compute_policy_loss_nsr.__name__ = compute_policy_loss_nsr.__qualname__ = f"compute_policy_loss_nsr_{rule}"
    compute_policy_loss_nsr.__doc__ = f"nsr rule {rule!r} as a verl loss mode ({__name__}.policy_loss)."
    return compute_policy_loss_nsr


def check_schedule(actor, train_batch_size: int) -> None:
    """Refuse an ``nsr:<rule>`` whose rule needs stale ratios (nsr.needs_stale_ratios) in a schedule without a stale
    update: with ``ppo_epochs`` 1 and ``ppo_mini_batch_size`` = ``data.train_batch_size`` (prompts) the actor makes one
    update per step on old log-probs it has just recomputed itself, so every ratio is 1, no token is clipped and the
    rule's update is the hard clip's. Allowed as they are: ``use_rollout_log_probs`` (old log-probs from the rollout
    engine, e.g. vLLM's, so a ratio is not 1 even on the first update) and ``policy_loss.allow_on_policy=true``.

    ``actor``: verl's ActorConfig (before the worker rescales its batch sizes); ``train_batch_size``: prompts per step.
    verl's ``ActorConfig.validate`` calls it once :func:`register` has run (verl's validate_config, before any
    worker starts)."""
    mode = actor.policy_loss.get("loss_mode", "")
    if not mode.startswith(PREFIX) or actor.get("use_rollout_log_probs", False):
        return
    if actor.policy_loss.get("allow_on_policy", False):
        return
    rule = mode.removeprefix(PREFIX)
    if not nsr.needs_stale_ratios(loss_config(rule, actor)):
        return
    minibatches = -(-train_batch_size // actor.ppo_mini_batch_size)  # verl splits the step's batch into these
    if actor.ppo_epochs * minibatches <= 1:
        a = "actor_rollout_ref.actor."
        raise ValueError(
            f"verl {a}ppo_epochs={actor.ppo_epochs} with {a}ppo_mini_batch_size={actor.ppo_mini_batch_size} and "
            f"data.train_batch_size={train_batch_size} is not valid with {a}policy_loss.loss_mode={mode!r}: one update "
            "per step on old log-probs the actor recomputed itself, so every ratio is 1, no token is clipped and the "
            f"rule equals the hard clip; allowed: {a}ppo_epochs >= 2, or {a}ppo_mini_batch_size <= "
            f"data.train_batch_size / 2, or +{a}policy_loss.allow_on_policy=true to run it anyway"
        )


def _install_schedule_check() -> None:
    """Make verl's ``ActorConfig.validate`` (which verl's ``validate_config`` calls with ``data.train_batch_size``
    before any worker starts, right after building the actor config and so after importing this module) also run
    :func:`check_schedule`. Idempotent."""
    from verl.workers.config import ActorConfig

    if getattr(ActorConfig.validate, "nsr_schedule_check", False):
        return
    original = ActorConfig.validate

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict = None):
        original(self, n_gpus, train_batch_size, model_config)
        check_schedule(self, train_batch_size)

    validate.__wrapped__ = original
    validate.__doc__ = original.__doc__
    validate.nsr_schedule_check = True
    ActorConfig.validate = validate


def loss_modes() -> list[str]:
    """The verl loss-mode name of every rule in ``nsr.RULES`` now."""
    return [PREFIX + rule for rule in nsr.RULES]


def register() -> list[str]:
    """Register every rule of ``nsr.RULES`` not yet registered as ``nsr:<rule>``; returns all our mode names.

    Raises RuntimeError if a mode name is taken by a function that is not ours (a clash with another plug-in). Also
    makes verl's ActorConfig.validate refuse schedules without a stale update (:func:`check_schedule`).
    """
    _install_schedule_check()
    for rule in nsr.RULES:
        name = PREFIX + rule
        have = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if have is None:
            core_algos.register_policy_loss(name)(make_policy_loss(rule))
        elif have.__module__ != __name__:
            raise RuntimeError(f"verl loss mode {name!r} is already registered by {have.__module__}.{have.__name__}")
    return loss_modes()


def recipe_overrides(loss: nsr.LossConfig, seed: int | None = None) -> list[str]:
    """The hydra overrides that make a verl recipe run ``loss`` (and, with ``seed``, seed its draws).

    The first two are the two recipe lines of the kit's docs (plugins.md); the trust region and dual clip go to
    verl's own actor keys; the rule's
    own parameters are keys verl's config does not have, hence hydra's ``+``. Composed into verl's trainer config and
    read back by :func:`loss_config`, they give ``loss`` again (tests/test_verl.py).
    """
    a = "actor_rollout_ref.actor."
    out = [
        f"{a}policy_loss._target_={__package__}.NSRPolicyLossConfig",
        f"{a}policy_loss.loss_mode={PREFIX}{loss.rule}",
        f"{a}clip_ratio_low={loss.eps_low!r}",
        f"{a}clip_ratio_high={loss.eps_high!r}",
        f"{a}tau_pos={loss.sapo_tau_pos!r}",
        f"{a}tau_neg={loss.sapo_tau_neg!r}",
    ]
    if loss.dual_clip is not None:
        out.append(f"{a}clip_ratio_c={loss.dual_clip!r}")
    elif loss.level == "token":
        out.append(f"+{a}policy_loss.dual_clip=false")
    defaults = {f.name: f.default for f in fields(NSRPolicyLossConfig)}
    for key in LOSS_KEYS:
        value = getattr(loss, key)
        if value != defaults[key]:
            out.append(f"+{a}policy_loss.{key}={'null' if value is None else value}")
    if seed is not None:
        out.append(f"+{a}policy_loss.seed={seed}")
    return out
