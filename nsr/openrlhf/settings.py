"""What the NSR layer adds to an OpenRLHF run: the ``--nsr.*`` flags of the launcher, as one frozen dataclass.

The flags are generated from the fields of ``nsr.LossConfig`` (``--nsr.<field>``) and ``nsr.AdvantageConfig``
(``--nsr.adv_<field>``), with the types of those fields (``typing.get_type_hints``: ``float | None`` accepts
``None``, a ``Literal`` gives the choices), so a new config field becomes a flag without a second declaration.
The clip region, dual clip and level have no flag: they come from OpenRLHF's own flags (``--actor.eps_clip_low_high``,
``--actor.dual_clip``, ``--actor.policy_loss_type``; nsr/openrlhf/mapping.py), so one value drives both OpenRLHF and
the rule. The other flags belong to the layer itself: ``--nsr.metrics_path``, ``--nsr.max_steps``, Dynamic Gradient
Gating's ``--nsr.dgg``, ``--nsr.dgg_k``, ``--nsr.dgg_window`` (nsr/openrlhf/gate.py), ``--nsr.allow_on_policy``
(nsr/openrlhf/launch.py's ``check_schedule``) and ``--nsr.fp32`` (a CPU run's float32 actor).

The launcher parses the flags, stores the object in ``args.nsr`` and it rides inside the pickled strategy to every
Ray actor. Nothing here imports openrlhf, so the argv builder and a dry run work on a machine without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field

from nsr.config import AdvantageConfig, LossConfig
from nsr.gating import GradientGate
from nsr.openrlhf.mapping import FROM_OPENRLHF

PREFIX = "--nsr."
ADV_PREFIX = "adv_"

LOSS_FIELDS = tuple(f for f in dataclasses.fields(LossConfig) if f.name not in FROM_OPENRLHF)
"""LossConfig fields that are ``--nsr.<name>`` flags."""
ADV_FIELDS = dataclasses.fields(AdvantageConfig)
"""AdvantageConfig fields, flags ``--nsr.adv_<name>``."""


def _converter(hint) -> tuple[typing.Callable[[str], object], tuple | None]:
    """(str -> value, choices or None) for a field type: Literal, X | None, float, int, bool, str."""
    if typing.get_origin(hint) is typing.Literal:
        return str, typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        conv, choices = _converter(inner[0])

        def optional(s: str):
            return None if s == "None" else conv(s)

        optional.__name__ = f"{conv.__name__} or None"  # argparse's message: "invalid float or None value"
        return optional, choices
    if hint is bool:

        def boolean(s: str) -> bool:
            return {"true": True, "false": False}[s.lower()]

        return boolean, None
    if hint in (int, float, str):
        return hint, None
    raise TypeError(f"no --nsr flag type for {hint!r}")


def _flags() -> dict[str, tuple[object, dataclasses.Field, type]]:
    """{flag name without prefix: (owner class, field, type)} for every --nsr flag."""
    out = {}
    for cls, fields, prefix in ((LossConfig, LOSS_FIELDS, ""), (AdvantageConfig, ADV_FIELDS, ADV_PREFIX)):
        hints = typing.get_type_hints(cls)
        for f in fields:
            out[prefix + f.name] = (cls, f, hints[f.name])
    hints = typing.get_type_hints(NSRSettings)
    for f in dataclasses.fields(NSRSettings):
        if f.name not in ("loss", "advantages"):
            out[f.name] = (NSRSettings, f, hints[f.name])
    return out


@dataclass(frozen=True)
class NSRSettings:
    """The run's ``--nsr.*`` flags. Build one with :meth:`make` (flag names) or :meth:`from_configs`."""

    loss: dict = field(default_factory=dict)
    """LossConfig keyword arguments given by flags (names of LOSS_FIELDS); the rest take LossConfig's defaults."""
    advantages: AdvantageConfig = AdvantageConfig()
    metrics_path: str = ""
    """metrics.jsonl the controller appends one row per RL step to ('' = do not write one)."""
    max_steps: int = 0
    """Stop after this many RL steps (train.steps), whatever data is left (0 = when OpenRLHF's data ends)."""
    dgg: bool = False
    """Dynamic Gradient Gating of the actor's optimizer steps (nsr/openrlhf/gate.py; train.dgg)."""
    dgg_k: float = 3.0
    """DGG: gate a step whose lm_head gradient norm exceeds dgg_k x the running median (train.dgg_k)."""
    dgg_window: int = 20
    """DGG: the running median is over the previous dgg_window optimizer steps (train.dgg_window)."""
    allow_on_policy: bool = False
    """Let a rule that needs stale ratios run with one optimizer step per rollout (refused otherwise: launch.py's
    check_schedule; train.allow_on_policy)."""
    fp32: bool = False
    """The actor in float32 (weights, gradients, Adam, log-probs) in place of ``--ds.param_dtype``, whose choices
    are bf16 and fp16; a CPU run only (nsr/openrlhf/cpu_shim.py loads the model in float32 and casts the weights to
    vLLM's bfloat16 at each sync; openrlhf.bf16=false)."""
    record_steps: str = ""
    """RL steps (comma-separated, e.g. ``1,11``) whose rollout batch each policy rank writes to ``record_dir``
    (nsr/openrlhf/record.py); '' = none."""
    record_dir: str = ""
    """Where the recorded batches go (``step<N>-rank<R>.pt``); needed with ``record_steps``."""

    def __post_init__(self):
        self.recorded_steps()  # validate now, driver side
        if bool(self.record_steps) != bool(self.record_dir):
            raise ValueError(
                f"--nsr.record_steps={self.record_steps!r} and --nsr.record_dir={self.record_dir!r}: "
                "allowed: both set or both empty"
            )
        unknown = sorted(set(self.loss) - {f.name for f in LOSS_FIELDS})
        if unknown:
            raise ValueError(f"NSRSettings.loss has {unknown}; allowed: {', '.join(f.name for f in LOSS_FIELDS)}")
        if not isinstance(self.max_steps, int) or self.max_steps < 0:
            raise ValueError(f"--nsr.max_steps={self.max_steps!r} is not valid; allowed: an integer >= 0")
        for name in ("dgg", "fp32"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"--nsr.{name}={getattr(self, name)!r} is not valid; allowed: true, false")
        try:
            GradientGate(self.dgg_k, self.dgg_window)
        except ValueError as e:
            raise ValueError(f"--nsr.{e}") from None
        self.loss_config()  # validate now (driver side), with nsr's own messages

    # ------------------------------------------------------------ constructors
    @classmethod
    def make(cls, **flags) -> NSRSettings:
        """From flag names without the prefix, e.g. ``make(rule="nsr", delta=0.1, adv_kind="no_std")``."""
        known = _flags()
        bad = sorted(set(flags) - set(known))
        if bad:
            raise ValueError(
                f"unknown flag {PREFIX}{bad[0]}; allowed --nsr flags: {', '.join(PREFIX + k for k in known)}"
            )
        loss = {k: v for k, v in flags.items() if known[k][0] is LossConfig}
        adv = {k[len(ADV_PREFIX) :]: v for k, v in flags.items() if known[k][0] is AdvantageConfig}
        own = {k: v for k, v in flags.items() if known[k][0] is NSRSettings}
        return cls(loss=loss, advantages=AdvantageConfig(**adv), **own)

    @classmethod
    def from_configs(cls, loss: LossConfig, advantages: AdvantageConfig, **own) -> NSRSettings:
        """From a RunConfig's loss and advantages (the fields OpenRLHF's flags set are left out)."""
        kw = {f.name: getattr(loss, f.name) for f in LOSS_FIELDS if getattr(loss, f.name) != f.default}
        return cls(loss=kw, advantages=advantages, **own)

    def recorded_steps(self) -> frozenset[int]:
        """The RL steps of ``record_steps``; ValueError naming the flag if one is not a positive integer."""
        parts = [p.strip() for p in self.record_steps.split(",")] if self.record_steps else []
        if not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(
                f"--nsr.record_steps={self.record_steps!r} is not valid; allowed: RL steps >= 1, comma-separated"
            )
        return frozenset(int(p) for p in parts)

    # ------------------------------------------------------------ the configs
    @property
    def rule(self) -> str:
        return self.loss.get("rule", LossConfig.rule)

    def loss_config(
        self, eps_low: float | None = None, eps_high: float | None = None, dual_clip=None, level: str = "token"
    ) -> LossConfig:
        """The rule as an nsr.LossConfig, with the region and level OpenRLHF's flags give."""
        return LossConfig(**self.loss, level=level, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)

    def advantage_config(self) -> AdvantageConfig:
        return self.advantages

    # ------------------------------------------------------------ flags
    def values(self) -> dict[str, object]:
        """{flag name: value} of every flag, set or default."""
        out = {}
        for name, (owner, f, _) in _flags().items():
            if owner is LossConfig:
                out[name] = self.loss.get(f.name, f.default)
            elif owner is AdvantageConfig:
                out[name] = getattr(self.advantages, f.name)
            else:
                out[name] = getattr(self, f.name)
        return out

    def to_argv(self) -> list[str]:
        """``--nsr.<flag> VALUE`` for every flag that differs from its default (a stable, minimal command)."""
        out = []
        for name, value in self.values().items():
            if value != _flags()[name][1].default:
                out += [f"{PREFIX}{name}", str(value)]
        return out

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for name, (_, _, hint) in _flags().items():
            conv, choices = _converter(hint)
            parser.add_argument(
                f"{PREFIX}{name}", dest=f"nsr_{name}", type=conv, choices=choices, default=argparse.SUPPRESS
            )

    @classmethod
    def parse(cls, argv: list[str]) -> tuple[NSRSettings, list[str]]:
        """(settings, the remaining argv) from a launcher command line; unknown --nsr.* flags are an error."""
        parser = argparse.ArgumentParser(
            prog="python -m nsr.openrlhf.launch", add_help=False, allow_abbrev=False, exit_on_error=False
        )
        cls.add_arguments(parser)
        try:
            ns, rest = parser.parse_known_args(argv)
        except argparse.ArgumentError as e:
            raise ValueError(str(e)) from None
        bad = [a for a in rest if a.startswith(PREFIX)]
        if bad:
            names = ", ".join(PREFIX + k for k in _flags())
            raise ValueError(f"unknown flag {bad[0].split('=')[0]!r}; allowed --nsr flags: {names}")
        given = {k[len("nsr_") :]: v for k, v in vars(ns).items()}
        return cls.make(**given), rest
