"""What the NSR layer adds to an OpenRLHF run: the ``--nsr.*`` flags of the launcher, as one frozen dataclass.

The clip region, dual clip and level are NOT here: they come from OpenRLHF's own flags (``--actor.eps_clip_low_high``,
``--actor.dual_clip``, ``--actor.policy_loss_type``), so one value drives both OpenRLHF and the rule. The launcher
parses these flags, stores the object in ``args.nsr`` and it rides inside the pickled strategy to every Ray actor.
Nothing here imports openrlhf, so the argv builder and a dry run work on a machine without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from dataclasses import dataclass

from nsr.config import AdvantageConfig, LossConfig

PREFIX = "--nsr."


@dataclass(frozen=True)
class NSRSettings:
    """The ``--nsr.<field>`` flags (defaults = plain OpenRLHF DAPO/GRPO behaviour, rule hard)."""

    rule: str = "hard"
    """nsr.LossConfig.rule: one of nsr.RULES."""
    delta: float | None = None
    """Half-width of z ~ U(1 - delta, 1 + delta); None = the level default (0.2 token, 4e-4 sequence)."""
    executor: str = "noisy"
    ratio_noise: float = 0.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    adv_kind: str = "group_norm"
    """nsr.AdvantageConfig.kind. group_norm / no_std are OpenRLHF's group_norm / dr_grpo estimators (the argv
    builder picks the estimator); positive_only and random_reward are applied by the launcher's controller."""
    adv_noise: float = 0.0
    adv_noise_mode: str = "mult"
    metrics_path: str = ""
    """metrics.jsonl the controller appends one row per RL step to ('' = do not write one)."""

    def __post_init__(self):
        self.loss_config()  # validate now (driver side), with nsr's own messages
        self.advantage_config()

    def loss_config(
        self, eps_low: float | None = None, eps_high: float | None = None, dual_clip=None, level: str = "token"
    ) -> LossConfig:
        """The rule as an nsr.LossConfig, with the region and level OpenRLHF's flags give."""
        return LossConfig(
            rule=self.rule,
            level=level,
            eps_low=eps_low,
            eps_high=eps_high,
            delta=self.delta,
            executor=self.executor,
            ratio_noise=self.ratio_noise,
            dual_clip=dual_clip,
            sapo_tau_pos=self.sapo_tau_pos,
            sapo_tau_neg=self.sapo_tau_neg,
        )

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(kind=self.adv_kind, noise=self.adv_noise, noise_mode=self.adv_noise_mode)

    # ------------------------------------------------------------ flags
    def to_argv(self) -> list[str]:
        """``--nsr.<field> VALUE`` for every field that differs from its default (a stable, minimal command)."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out += [f"{PREFIX}{f.name}", str(v)]
        return out

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            kind = float if f.type in ("float", "float | None") else str
            parser.add_argument(f"{PREFIX}{f.name}", dest=f"nsr_{f.name}", type=kind, default=f.default)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> NSRSettings:
        return cls(**{f.name: getattr(ns, f"nsr_{f.name}") for f in dataclasses.fields(cls)})

    @classmethod
    def parse(cls, argv: list[str]) -> tuple[NSRSettings, list[str]]:
        """(settings, the remaining argv) from a launcher command line; unknown --nsr.* flags are an error."""
        parser = argparse.ArgumentParser(prog="python -m nsr.openrlhf.launch", add_help=False, allow_abbrev=False)
        cls.add_arguments(parser)
        ns, rest = parser.parse_known_args(argv)
        bad = [a for a in rest if a.startswith(PREFIX)]
        if bad:
            names = ", ".join(PREFIX + f.name for f in dataclasses.fields(cls))
            raise ValueError(f"unknown flag {bad[0].split('=')[0]!r}; allowed --nsr flags: {names}")
        return cls.from_namespace(ns), rest


def stream_seed(*parts: int | str) -> int:
    """A 63-bit seed for a torch.Generator from a tuple like (train seed, rank, RL step, micro-step).

    Hashing (not adding) keeps the streams of neighbouring tuples unrelated, and the value depends only on the
    tuple, so a resumed run draws exactly what an uninterrupted one would.
    """
    blob = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1
