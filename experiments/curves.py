"""Live curves of a run (``logging.report_to``): the run folder's rows, mirrored as scalars while the run trains.

    python -m experiments.run sweeps/presets/tiny.yaml logging.report_to=tensorboard --out /tmp/r
    tensorboard --logdir /tmp/r/tensorboard

``experiments.run`` opens one :class:`Curves` per run of the tiny and trl backends (the openrlhf backend writes
OpenRLHF's own TensorBoard events under RUN/tensorboard/ whatever the value) and hands it to the run folder
(``RunDir.curves``): every row a backend appends to metrics.jsonl, ratio_bins.jsonl or eval.jsonl is logged at its
step, under the same names for both backends (:func:`scalars`):

* ``train/<key>`` for every number of a metrics.jsonl row (``train/reward_mean``, ``train/clip_frac_low``,
  ``train/clip_frac_high``, ``train/entropy``, ``train/grad_norm``, ...);
* ``premise/<key>`` for the premise meter's per-token rates (nsr.premise.RATE_KEYS: ``premise/pos_clipped_zone``,
  ...) from a ratio_bins.jsonl row and its token count, and ``premise/tokens``;
* ``eval/<benchmark>/<decoding>``: the mean accuracy of an evaluation's rows (pass@1).

Values: ``none`` (the default: nothing), ``tensorboard`` (events under RUN/tensorboard/, torch's SummaryWriter) and
``wandb`` (offline, under RUN/wandb/, where the optional wandb package is installed; ``wandb sync`` uploads it).
Not part of a run's identity (the ``logging`` section is not): the curves change no logged number.
"""

from __future__ import annotations

import math
from pathlib import Path

from experiments.config import REPORT_TO

TB_DIR = "tensorboard"
WANDB_DIR = "wandb"


def check(report_to: str, backend: str) -> None:
    """Refuse, before any work, a value this machine or backend cannot honour (ConfigError naming the field)."""
    import importlib.util

    from experiments.config_errors import ConfigError

    if report_to == "wandb" and backend == "openrlhf":
        raise ConfigError(
            "logging.report_to='wandb' is not valid with backend='openrlhf': the openrlhf backend writes OpenRLHF's "
            "own TensorBoard events under RUN/tensorboard/; allowed: none, tensorboard"
        )
    if report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.report_to='wandb' needs the wandb package, which is not installed (optional: pip install wandb); "
            "allowed here: none, tensorboard"
        )


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(name: str, row: dict) -> dict[str, float]:
    """The scalars of one row of run-folder log ``name``: metrics.jsonl or ratio_bins.jsonl (eval rows:
    :func:`eval_scalars`)."""
    if name == "metrics.jsonl":
        return {f"train/{k}": float(v) for k, v in row.items() if k != "step" and _number(v)}
    if name == "ratio_bins.jsonl" and row.get("tokens"):
        from nsr.premise import N_BINS

        t = float(row["tokens"])
        out = {"premise/tokens": t}
        for side in ("pos", "neg"):
            clipped, rescued, weight = row[f"{side}_clipped"], row[f"{side}_rescued"], row[f"{side}_weight"]
            out[f"premise/{side}_clipped_zone"] = sum(clipped[:N_BINS]) / t
            out[f"premise/{side}_clipped_deep"] = clipped[N_BINS] / t
            out[f"premise/{side}_rescued"] = sum(rescued) / t
            out[f"premise/{side}_weight"] = sum(weight) / t
        return out
    return {}


def eval_scalars(rows: list[dict]) -> dict[int, dict[str, float]]:
    """{step: {``eval/<benchmark>/<decoding>``: mean of ``correct``}} of eval.jsonl rows."""
    acc: dict[int, dict[str, list[int]]] = {}
    for r in rows:
        acc.setdefault(r["step"], {}).setdefault(f"eval/{r['benchmark']}/{r['decoding']}", []).append(r["correct"])
    return {step: {k: sum(v) / len(v) for k, v in tags.items()} for step, tags in acc.items()}


class Curves:
    """One run's scalar writer. ``rows(name, rows)`` logs the rows of a run-folder log; ``close()`` flushes."""

    def __init__(self, run_dir: str | Path, report_to: str, run_name: str = "", config: dict | None = None):
        if report_to not in REPORT_TO:
            raise ValueError(f"logging.report_to={report_to!r} is not valid; allowed: {', '.join(REPORT_TO)}")
        self.report_to = report_to
        self.path = Path(run_dir)
        self._tb = self._wandb = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.path / TB_DIR))
        elif report_to == "wandb":
            import wandb

            (self.path / WANDB_DIR).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                mode="offline", dir=str(self.path), project="nsr-repro", name=run_name or self.path.name,
                config=config or {}, reinit="create_new",
            )  # fmt: skip

    def log(self, step: int, values: dict[str, float]) -> None:
        if self._tb is not None:
            for tag, v in values.items():
                self._tb.add_scalar(tag, v, global_step=step)
        if self._wandb is not None and values:
            self._wandb.log({**values, "step": step})

    def rows(self, name: str, rows: list[dict]) -> None:
        if name == "eval.jsonl":
            for step, values in sorted(eval_scalars(rows).items()):
                self.log(step, values)
            return
        for row in rows:
            values = scalars(name, row)
            if values:
                self.log(int(row["step"]), values)
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
