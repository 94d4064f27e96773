"""ConfigError, the error of a bad config value, and the helpers that raise it naming the field (nsr.value_checks with
ConfigError); the config sections, tasks and every backend's config_checks use them.

check_field("train", "minibatches", 256 % 3 == 0, "a divisor of 256", 3)
# ConfigError: train.minibatches=3 is not valid; allowed: a divisor of 256
"""

from __future__ import annotations

from nsr.value_checks import check, is_number


class ConfigError(ValueError):
    """A bad config value or key; the message names the source, the key and the allowed values."""


def check_field(cls: str, key: str, ok: bool, allowed: str, value) -> None:
    """Raise ConfigError "<cls>.<key>=<value> is not valid; allowed: <allowed>" unless ``ok``."""
    check(ok, f"{cls}.{key}", value, allowed, ConfigError)


def check_range(cls: str, key: str, value, lo=None, hi=None, *, lo_open: bool = False) -> None:
    """``value`` finite and in [lo, hi] (``(lo, hi]`` with ``lo_open``); ConfigError naming the key otherwise.

    Non-finite floats never get here from YAML or ``key=value`` (the loader refuses them); this also covers
    dataclasses built in Python.
    """
    parts = []
    if lo is not None:
        parts.append(f"> {lo}" if lo_open else f">= {lo}")
    if hi is not None:
        parts.append(f"<= {hi}")
    allowed = "a finite number " + " and ".join(parts) if parts else "a finite number"
    ok = is_number(value)
    ok = ok and (lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi)
    check_field(cls, key, ok, allowed, value)


def check_verifier_reward(cfg) -> None:
    """reward.source is verifier: label-free rewards are implemented by the tiny backend's loop only (the checks of
    every other backend call this)."""
    allowed = "verifier (label-free rewards are a tiny-backend option)"
    check_field("reward", "source", cfg.reward.source == "verifier", allowed, cfg.reward.source)
