"""Checks of one value, and the one error message they all raise: every bad value of the repo gets the same error,
naming the key and what is allowed (was nsr/validate.py; that path still imports).

    check(0 <= delta < 1, "LossConfig.delta", delta, "a finite number with 0 <= delta < 1")
    # ValueError: LossConfig.delta=1.5 is not valid; allowed: a finite number with 0 <= delta < 1

nsr's configs raise ValueError; the harness passes its own subclass (``experiments.config_errors.ConfigError``) as
``error``, so a bad sweep value and a bad LossConfig read the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable


def check(ok: bool, key: str, value, allowed: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error("<key>=<value!r> is not valid; allowed: <allowed>")`` unless ``ok``."""
    if not ok:
        raise error(f"{key}={value!r} is not valid; allowed: {allowed}")


def is_number(value) -> bool:
    """A finite real number (bool, NaN and +-inf are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(
    key: str, value, allowed: str, ok: Callable[[float], bool] = lambda v: True, error: type[Exception] = ValueError
) -> None:
    """``value`` a finite real number passing ``ok``; else the error with "allowed: a finite number with <allowed>"."""
    check(is_number(value) and ok(value), key, value, f"a finite number with {allowed}", error)


def check_choice(key: str, value, choices: Iterable, error: type[Exception] = ValueError) -> None:
    """``value`` one of ``choices``; else the error listing them."""
    choices = tuple(choices)
    check(value in choices, key, value, ", ".join(map(str, choices)), error)
