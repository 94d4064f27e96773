"""Run folders -> tidy pandas frames (design.md, "Run directory contract").

    from analysis.load import load_runs
    rs = load_runs("results/runs")          # every results/runs/<sweep>/<run_id>/
    rs.runs      # one row per run folder: run, sweep, run_id, state, included, arm, label, seed, point, ...,
                 #   and every RunConfig field as a dotted column (loss.rule, loss.delta, train.lr, ...)
    rs.steps     # one row per (run, step) of metrics.jsonl (or OpenRLHF TensorBoard events): reward_mean, ...
    rs.eval_samples()   # one row per eval sample: run, step, benchmark, problem_id, decoding, sample, correct
    rs.eval_counts()    # per (run, step, benchmark, decoding, problem_id): n samples, c correct (what pass@k needs)
    rs.ratio_bins()     # per (run, side, bin): clipped / rescued tokens by depth into the rescue zone (tiny runs)
    rs.issues    # what was wrong: failed / running / cancelled runs, missing files, truncated or corrupt lines

Nothing here crashes on a bad folder: a missing config, a failed run, a truncated last line (a crash mid-write)
or a corrupt line gives a :class:`RunWarning` and an entry in ``rs.issues``. Only runs whose state is in
``states`` (default: done) enter ``steps`` and the eval frames; the others are listed, never silently mixed in.

A run's ``label`` is its arm plus its grid point (``nsr delta=0.2``): the unit a table row or a curve stands for.
Runs of one label differ only by seed.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.json as pj
import yaml

from experiments.rundir import REPO_ROOT, RunDir, read_rows

RUNS_ROOT = REPO_ROOT / "results" / "runs"
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it (10x faster on 100 config.yaml files), else the Python one."""
DONE_ONLY = ("done",)
EVAL_COLUMNS = ("step", "benchmark", "problem_id", "decoding", "sample", "correct")
COUNT_KEYS = ["run", "step", "benchmark", "decoding", "problem_id"]
BIN_FIELDS = ("clipped", "rescued", "weight")


class RunWarning(UserWarning):
    """A run folder that is incomplete, failed or partly unreadable (also recorded in ``RunSet.issues``)."""


@dataclass(frozen=True)
class Issue:
    """One thing wrong with one run folder."""

    sweep: str
    run_id: str
    kind: str
    """no_config | bad_config | no_status | running | failed | cancelled | unknown_state | no_metrics |
    truncated | corrupt_lines | duplicate_steps | no_eval | bad_eval"""
    message: str

    def __str__(self) -> str:
        return f"{self.sweep}/{self.run_id}: {self.kind}: {self.message}"


@dataclass
class RunSet:
    """The loaded runs of one results folder (see the module docstring for the frames)."""

    root: Path
    runs: pd.DataFrame
    steps: pd.DataFrame
    issues: list[Issue] = field(default_factory=list)
    _eval_files: dict[str, Path] = field(default_factory=dict, repr=False)
    _counts: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def included(self) -> pd.DataFrame:
        """The runs that enter the tables and figures."""
        return self.runs[self.runs["included"]]

    def eval_samples(self) -> pd.DataFrame:
        """Per-sample eval labels of the included runs: run, step, benchmark, problem_id (str), decoding, sample,
        correct (0/1)."""
        frames = []
        for run, path in self._eval_files.items():
            df = self._read_eval(run, path)
            if df is not None and len(df):
                df.insert(0, "run", run)
                frames.append(df)
        if not frames:
            return pd.DataFrame({c: pd.Series(dtype=object) for c in ("run", *EVAL_COLUMNS)})
        out = pd.concat(frames, ignore_index=True)
        out["problem_id"] = out["problem_id"].astype(str)
        return out

    def eval_counts(self) -> pd.DataFrame:
        """Per (run, step, benchmark, decoding, problem_id): ``n`` samples and ``c`` correct ones. Cached."""
        if self._counts is None:
            frames = []
            for run, path in self._eval_files.items():
                g = self._read_eval(run, path, count_eval)
                if g is not None and len(g):
                    g.insert(0, "run", run)
                    frames.append(g)
            cols = {c: pd.Series(dtype=object) for c in COUNT_KEYS} | {"n": pd.Series(dtype="int64")}
            self._counts = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(cols | {"c": cols["n"]})
        return self._counts

    def ratio_bins(self, runs=None) -> pd.DataFrame:
        """Clipped tokens by depth into the rescue zone, summed over the steps of each included run that logged
        ratio_bins.jsonl (tiny backend, token level): run, delta, executor, side (pos | neg), bin (0..n-1 over
        depth [0, 1), n = deeper), clipped, rescued, weight (summed gradient weight of the rescued tokens).
        ``runs``: only these runs (``sweep/run_id``), so the others' files are not read."""
        frames = []
        inc = self.included if runs is None else self.included[self.included["run"].isin(runs)]
        for rec in inc.itertuples():
            path = RunDir(rec.path).log_path("ratio_bins.jsonl")
            if not path.exists():
                continue
            rows, bad = read_rows(path)
            sweep, run_id = rec.run.split("/", 1)
            for kind, msg in bad:
                self._issue(Issue(sweep, run_id, kind, f"ratio_bins.jsonl: {msg}"))
            if not rows:
                continue
            for side in ("pos", "neg"):
                sums = {w: [sum(col) for col in zip(*(r[f"{side}_{w}"] for r in rows))] for w in BIN_FIELDS}
                frames.append(
                    pd.DataFrame(
                        {"run": rec.run, "delta": rows[0]["delta"], "executor": rows[0]["executor"], "side": side}
                        | {"bin": range(len(sums["clipped"]))}
                        | sums
                    )
                )
        if not frames:
            cols = ("run", "delta", "executor", "side", "bin", *BIN_FIELDS)
            return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
        return pd.concat(frames, ignore_index=True)

    def _read_eval(self, run: str, path: Path, reader=None) -> pd.DataFrame | None:
        sweep, run_id = run.split("/", 1)
        try:
            df, bad = (reader or read_eval)(path)
        except (OSError, ValueError) as e:
            self._issue(Issue(sweep, run_id, "bad_eval", f"{path.name} unreadable: {e}"))
            return None
        for kind, msg in bad:
            self._issue(Issue(sweep, run_id, kind, f"{path.name}: {msg}"))
        return df

    def _issue(self, issue: Issue) -> None:
        if issue not in self.issues:
            self.issues.append(issue)
            warnings.warn(str(issue), RunWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- readers
def _arrow_eval(path: Path):
    """The eval file as a pyarrow Table, or None when pyarrow cannot parse it (a truncated or corrupt line, NaN).

    pyarrow comes with ``datasets``; its JSON reader is ~3x faster than json.loads on these files."""
    try:
        table = pj.read_json(str(path))
    except (pa.ArrowInvalid, OSError, EOFError):
        return None
    return table.select([c for c in EVAL_COLUMNS if c in table.column_names])


def _normalise_eval(df: pd.DataFrame) -> pd.DataFrame:
    if not len(df):
        return pd.DataFrame(
            {c: pd.Series(dtype="int64" if c in ("step", "sample", "correct") else object) for c in EVAL_COLUMNS}
        )
    missing = [c for c in ("step", "problem_id", "correct") if c not in df.columns]
    if len(df) and missing:
        raise ValueError(f"rows lack the field(s) {', '.join(missing)}; expected {', '.join(EVAL_COLUMNS)}")
    for col, value in {"benchmark": "eval", "decoding": "sampled", "sample": 0}.items():
        if col not in df.columns:
            df[col] = value
    if len(df):
        df["correct"] = df["correct"].astype(float).round().astype("int64")
        df["step"] = df["step"].astype("int64")
    return df[[c for c in EVAL_COLUMNS if c in df.columns]]


def read_eval(path: Path) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """eval.jsonl(.gz) -> frame with EVAL_COLUMNS (extra fields dropped) and the problems found (as read_rows)."""
    table = _arrow_eval(path)
    if table is not None:
        return _normalise_eval(table.to_pandas()), []
    rows, problems = read_rows(path)
    return _normalise_eval(pd.DataFrame(rows)), problems


def count_eval(path: Path) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """Per (step, benchmark, decoding, problem_id) of one eval file: ``n`` samples, ``c`` correct; and problems.

    Counted inside pyarrow when it parses the file, so no per-sample frame is built (100 runs x 50k labels).
    """
    table = _arrow_eval(path)
    keys = COUNT_KEYS[1:]
    if table is not None and {"step", "problem_id", "correct"} <= set(table.column_names):
        for col, value in {"benchmark": "eval", "decoding": "sampled"}.items():
            if col not in table.column_names:
                table = table.append_column(col, pa.array([value] * len(table)))
        g = table.group_by(keys).aggregate([("correct", "count"), ("correct", "sum")]).to_pandas()
        g = g.rename(columns={"correct_count": "n", "correct_sum": "c"})
        problems: list[tuple[str, str]] = []
    else:
        df, problems = read_eval(path)
        g = df.groupby(keys, sort=False)["correct"].agg(n="size", c="sum").reset_index()
    g["problem_id"] = g["problem_id"].astype(str)
    g["c"] = g["c"].round().astype("int64")
    g["n"] = g["n"].astype("int64")
    return g.sort_values(keys, kind="stable").reset_index(drop=True)[[*keys, "n", "c"]], problems


# ---------------------------------------------------------------------------------------------- folders
def find_run_dirs(root: Path) -> list[Path]:
    """Run folders under ``root``: ``root/<sweep>/<run_id>/``; ``root`` may also be one sweep or one run folder.
    Folders whose name starts with ``_`` or ``.`` (scratch) are skipped."""

    def is_run(p: Path) -> bool:
        return any((p / f).exists() for f in ("config.yaml", "status.json", "metrics.jsonl"))

    def visible(p: Path) -> bool:
        return p.is_dir() and not p.name.startswith(("_", "."))

    if is_run(root):
        return [root]
    children = sorted(p for p in root.iterdir() if visible(p)) if root.is_dir() else []
    if children and any(is_run(c) for c in children):
        return [c for c in children if is_run(c)]
    return [r for c in children for r in sorted(r for r in c.iterdir() if visible(r) and is_run(r))]


def flatten(d: dict, prefix: str = "") -> dict:
    """{"loss": {"rule": "nsr"}} -> {"loss.rule": "nsr"}; lists become tuples (hashable columns)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = tuple(v) if isinstance(v, list) else v
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def make_label(arm: str, point: dict) -> str:
    """``arm`` plus the grid point's values keyed by the last part of each dotted key: ``nsr delta=0.2``."""
    parts = [f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in sorted(point.items()) if k != "seed"]
    return " ".join([arm, *parts])


def _state(status: dict | None) -> str:
    if status is None:
        return "missing"
    return str(status.get("state", "unknown"))


def _read_status(path: Path) -> dict | None:
    try:
        return json.loads((path / "status.json").read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, OSError):
        return {"state": "unknown"}


def _tensorboard_rows(path: Path) -> list[dict] | None:
    if not any(path.rglob("events.out.tfevents.*")):
        return None
    from experiments.openrlhf.metrics import rows_from_tensorboard

    return rows_from_tensorboard(path)


def _steps_frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "step" not in df.columns:
        return pd.DataFrame()
    df = df[pd.to_numeric(df["step"], errors="coerce").notna()]
    df = df.astype({"step": "int64"})
    for col in df.columns:
        if col != "step" and df[col].dtype == object:
            conv = pd.to_numeric(df[col], errors="coerce")
            if conv.notna().sum() == df[col].notna().sum():  # all values numeric (None -> NaN)
                df[col] = conv
    if "clip_frac" not in df.columns and {"clip_frac_low", "clip_frac_high"} <= set(df.columns):
        df["clip_frac"] = df["clip_frac_low"] + df["clip_frac_high"]
    return df


def load_runs(
    root: str | Path = RUNS_ROOT, *, sweeps: list[str] | None = None, states: tuple[str, ...] = DONE_ONLY
) -> RunSet:
    """Load every run folder under ``root``.

    Args:
        root: a results folder (``<root>/<sweep>/<run_id>/``), one sweep folder, or one run folder.
        sweeps: keep only these sweep names (None: all).
        states: run states whose data enter ``steps`` and the eval frames (e.g. ``("done", "running")`` to look
            at live runs); the rest are listed in ``runs`` with ``included = False`` and in ``issues``.
    """
    root = Path(root)
    issues: list[Issue] = []

    def issue(sweep, run_id, kind, msg):
        it = Issue(sweep, run_id, kind, msg)
        issues.append(it)
        warnings.warn(str(it), RunWarning, stacklevel=3)

    records, step_frames, eval_files = [], [], {}
    for path in find_run_dirs(root):
        sweep_dir = path.parent.name if path != root else "adhoc"
        run_id = path.name
        try:
            config = yaml.load((path / "config.yaml").read_text(), Loader=YAML_LOADER) or {}
            if not isinstance(config, dict):
                raise ValueError("top level is not a mapping")
        except FileNotFoundError:
            issue(sweep_dir, run_id, "no_config", "no config.yaml; folder skipped")
            continue
        except (yaml.YAMLError, ValueError) as e:
            issue(sweep_dir, run_id, "bad_config", f"config.yaml unreadable ({e}); folder skipped")
            continue
        meta = config.pop("meta", None) or {}
        config.pop("preset", None)
        sweep = meta.get("sweep") or sweep_dir
        if sweeps is not None and sweep not in sweeps:
            continue
        run_id = meta.get("run_id") or run_id
        run = f"{sweep}/{run_id}"
        status = _read_status(path)
        state = _state(status)
        included = state in states
        if state == "missing":
            issue(sweep, run_id, "no_status", "no status.json (never started, or not a run folder)")
        elif state in ("running", "failed", "cancelled"):
            err = (status or {}).get("error")
            issue(
                sweep,
                run_id,
                state,
                f"state {state}" + (f": {err}" if err else "") + ("" if included else "; excluded"),
            )
        elif state != "done":
            issue(sweep, run_id, "unknown_state", f"status.json has state {state!r}")

        flat = flatten(config)
        point = dict(meta.get("point") or {})
        arm = meta.get("arm") or flat.get("loss.rule", "run")
        seed = meta.get("seed", flat.get("seed"))
        rec = {
            "run": run,
            "sweep": sweep,
            "run_id": run_id,
            "path": str(path),
            "state": state,
            "included": included,
            "arm": arm,
            "label": make_label(arm, point),
            "seed": seed,
            "baseline": meta.get("baseline"),
            "point": point,
            "error": (status or {}).get("error"),
            **flat,
            **{f"meta.{k}": v for k, v in flatten(meta).items() if k not in ("sweep", "arm", "seed", "baseline")},
        }

        steps = pd.DataFrame()
        rd = RunDir(path)
        if rd.metrics_path.exists():
            rows, probs = read_rows(rd.metrics_path)
            for kind, msg in probs:
                issue(sweep, run_id, kind, f"metrics.jsonl: {msg}")
            steps = _steps_frame(rows)
        else:
            tb = _tensorboard_rows(path)
            if tb is None:
                if state != "missing":
                    issue(sweep, run_id, "no_metrics", "no metrics.jsonl and no TensorBoard events")
            else:
                steps = _steps_frame(tb)
                rec["metrics_source"] = "tensorboard"
        if len(steps):
            dup = steps["step"].duplicated(keep="last")
            if dup.any():
                issue(sweep, run_id, "duplicate_steps", f"{int(dup.sum())} repeated step(s); kept the last of each")
                steps = steps[~dup]
            steps = steps.sort_values("step", kind="stable")
        rec["n_steps"] = len(steps)
        rec["last_step"] = int(steps["step"].max()) if len(steps) else -1
        eval_path = rd.eval_path if rd.eval_path.exists() else None
        rec["has_eval"] = eval_path is not None
        if included and eval_path is None and state == "done":
            issue(sweep, run_id, "no_eval", "no eval.jsonl(.gz): pass@k columns are empty for this run")
        records.append(rec)
        if included:
            if len(steps):
                steps.insert(0, "run", run)
                step_frames.append(steps)
            if eval_path is not None:
                eval_files[run] = eval_path

    runs = pd.DataFrame(records)
    if len(runs) and "meta.preset" in runs.columns:
        _split_presets(runs)
    if not len(runs):
        runs = pd.DataFrame(
            {c: pd.Series(dtype=object) for c in ("run", "sweep", "run_id", "state", "arm", "label", "seed", "point")}
            | {"included": pd.Series(dtype=bool)}
        )
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame({"run": [], "step": []})
    return RunSet(root=root, runs=runs.reset_index(drop=True), steps=steps, issues=issues, _eval_files=eval_files)


def _split_presets(runs: pd.DataFrame) -> None:
    """A sweep whose runs come from several presets (e.g. tiny and tiny-smoke in one results folder): the preset
    joins each run's grid point and label, so runs of different presets are never averaged or paired together."""
    for _, g in runs.groupby("sweep"):
        if g["meta.preset"].nunique(dropna=True) < 2:
            continue
        for i in g.index:
            point = runs.at[i, "point"]
            if "preset" not in point and isinstance(runs.at[i, "meta.preset"], str):
                point = {**point, "preset": runs.at[i, "meta.preset"]}
                runs.at[i, "point"] = point
                runs.at[i, "label"] = make_label(runs.at[i, "arm"], point)


def status_report(rs: RunSet, expected: dict[str, list[str]] | None = None) -> dict[str, dict[str, list[str]]]:
    """Per sweep: {"done": [...], "running": [...], "failed": [...], ..., "missing": [...]} run ids.

    ``expected`` maps a sweep to the run ids its sweep file defines; ids with no folder are listed as missing.
    """
    out: dict[str, dict[str, list[str]]] = {}
    for sweep, g in rs.runs.groupby("sweep", sort=True):
        out[sweep] = {st: sorted(gg["run_id"]) for st, gg in g.groupby("state", sort=True)}
    for sweep, ids in (expected or {}).items():
        have = set(rs.runs.loc[rs.runs["sweep"] == sweep, "run_id"])
        missing = sorted(set(ids) - have)
        out.setdefault(sweep, {})
        if missing:
            out[sweep]["missing"] = missing
    return out
