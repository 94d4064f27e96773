"""OpenRLHF 0.11.2's TensorBoard logs -> the run folder's metrics.jsonl rows (docs/design.md).

The launcher writes metrics.jsonl from the controller (``nsr.openrlhf.metrics.row_from_logs``); this rebuilds the
same rows from event files: a cluster run that only kept TensorBoard, or a plain OpenRLHF run.

    from experiments.openrlhf.tensorboard import rows_from_tensorboard
    rows = rows_from_tensorboard("results/runs/main/<run_id>/tensorboard")   # list of rows, by step
    bins = ratio_bins_from_tensorboard("results/runs/main/<run_id>/tensorboard", cfg.loss)  # ratio_bins.jsonl rows
"""

from __future__ import annotations

from pathlib import Path

from nsr.openrlhf.metrics import TB_PREFIX, premise_row_from_logs, row_from_logs


def _event_dirs(logdir: Path) -> list[Path]:
    """Folders under ``logdir`` (itself included) that hold TensorBoard event files."""
    dirs = {p.parent for p in logdir.rglob("events.out.tfevents.*") if p.is_file()}
    return sorted(dirs)


def read_scalars(logdir: str | Path) -> dict[int, dict[str, tuple[float, float]]]:
    """{step: {tag: (wall_time, value)}} over every event file under ``logdir``.

    A resumed run writes new event files that repeat the steps logged after its last checkpoint; for a repeated
    (step, tag) the value with the latest wall time wins, as in the resumed run's own history.
    """
    from tensorboard.backend.event_processing import event_accumulator

    logdir = Path(logdir)
    if not logdir.is_dir():
        raise FileNotFoundError(f"{logdir}: no such TensorBoard log folder")
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for d in _event_dirs(logdir):
        for f in sorted(d.glob("events.out.tfevents.*")):
            acc = event_accumulator.EventAccumulator(str(f), size_guidance={event_accumulator.SCALARS: 0})
            acc.Reload()
            for tag in acc.Tags().get("scalars", []):
                for ev in acc.Scalars(tag):
                    prev = out.setdefault(ev.step, {}).get(tag)
                    if prev is None or ev.wall_time >= prev[0]:
                        out[ev.step][tag] = (ev.wall_time, ev.value)
    return out


def rows_from_tensorboard(logdir: str | Path) -> list[dict]:
    """metrics.jsonl rows (sorted by step) rebuilt from the ``train/*`` scalars of OpenRLHF's TensorBoard logs.

    Args:
        logdir: ``--logger.tensorboard_dir`` (holding a ``<run_name>/`` folder) or the event folder itself.

    Returns:
        One :func:`row_from_logs` row per step that has ``train/*`` scalars, plus ``wall_time`` (unix seconds of
        the step's last event). ``eval/*`` scalars (OpenRLHF's online eval) are not metrics rows and are skipped.
    """
    rows = []
    for step, tags in sorted(read_scalars(logdir).items()):
        train = {t: v for t, (_, v) in tags.items() if t.startswith(TB_PREFIX)}
        if not train:
            continue
        row = row_from_logs(step, train)
        row["wall_time"] = max(w for t, (w, _) in tags.items() if t.startswith(TB_PREFIX))
        rows.append(row)
    return rows


def ratio_bins_from_tensorboard(logdir: str | Path, loss) -> list[dict]:
    """ratio_bins.jsonl rows (sorted by step) rebuilt from the premise meter's ``train/nsr_premise_*`` scalars
    (nsr.openrlhf.metrics.premise_row_from_logs); ``loss``: the run's nsr.LossConfig (delta, executor). Steps without
    them (sequence level, a plain OpenRLHF run) give no row."""
    rows = []
    for step, tags in sorted(read_scalars(logdir).items()):
        row = premise_row_from_logs(step, {t: v for t, (_, v) in tags.items() if t.startswith(TB_PREFIX)}, loss)
        if row is not None:
            rows.append(row)
    return rows
