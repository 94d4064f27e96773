"""openrlhf-backend checks of a RunConfig, run at its construction (before any run folder exists). How the fields fit
together for OpenRLHF is checked by the argv builder (experiments/openrlhf/argv.py) at preflight."""

from __future__ import annotations

from experiments.config_errors import check_verifier_reward


def check_config(cfg) -> None:
    """openrlhf-backend checks of a RunConfig; ConfigError naming the key and the allowed values."""
    check_verifier_reward(cfg)
