"""Run folders -> tidy pandas frames (docs/design.md, "Run directory contract").

    from analysis.load import load_runs
    rs = load_runs("results/runs")          # every run folder under results/runs/, at any depth
    rs.runs      # one row per run folder: run, folder, hash, sweep, run_id, state, included, arm, label, seed,
                 #   point, copy_of, problem, and every RunConfig field as a dotted column (loss.rule, ...)
    rs.members   # one row per (sweep, included run): run, sweep, run_id, arm, label, seed, baseline, point, preset
    rs.steps     # one row per (run, step) of metrics.jsonl (or OpenRLHF TensorBoard events): reward_mean, ...
    rs.eval_samples()   # one row per eval sample: run, step, benchmark, problem_id, decoding, sample, correct
    rs.eval_counts()    # per (run, step, benchmark, decoding, problem_id): n samples, c correct (what pass@k needs)
    rs.ratio_bins()     # per (run, side, bin): clipped / rescued tokens by depth into the rescue zone (token level)
    rs.issues    # what was wrong: failed / running / cancelled runs, missing files, truncated or corrupt lines

Nothing here crashes on a bad folder: a missing config, a failed run, a truncated last line (a crash mid-write)
or a corrupt line gives a :class:`RunWarning` and an entry in ``rs.issues``. Only runs whose state is in
``states`` (default: done) enter ``steps`` and the eval frames; the others are listed, never silently mixed in.
A done run whose logs fall short of its configured steps, lack the final eval, or hold a value that is not a finite
number is ``incomplete`` and excluded the same way.

A run is its config hash: the same config in several folders (a sweep that shares another's run, a copy under
``backup/``) is read once, and it is a member of every sweep whose sweep file holds that config (``rs.members``).

A run's ``label`` is its arm plus its grid point (``nsr delta=0.2``): the unit a table row or a curve stands for.
Runs of one label differ only by seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
import shutil
import warnings
import zlib
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from analysis.parallel import InlinePool, ready
from experiments.rundir import REPO_ROOT, RunDir, RunFolderError, atomic_path, cache_dir, read_rows, stored_identity

RUNS_ROOT = REPO_ROOT / "results" / "runs"
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
    """no_config | bad_config | bad_meta | no_status | bad_status | running | failed | cancelled | no_metrics |
    truncated | corrupt_lines | duplicate_steps | no_eval | bad_eval | incomplete | copy"""
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
    members: pd.DataFrame = field(default_factory=pd.DataFrame)
    notes: list[str] = field(default_factory=list)
    _eval_files: dict[str, Path] = field(default_factory=dict, repr=False)
    _counts: pd.DataFrame | None = field(default=None, repr=False)
    expansions: dict = field(default_factory=dict, repr=False)
    """{(sweep file, preset, presets_dir): [(sweep, run id)]}: the sweep files as expanded to match the runs
    (:func:`sweep_members`)."""
    _bins: dict = field(default_factory=dict, repr=False)
    """{run: what :func:`_run_bins` returned}: each run's ratio bins, read once."""

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
        ratio_bins.jsonl (nsr.PremiseMeter, token level): run, delta, executor, side (pos | neg), bin (0..n-1 over
        depth [0, 1), n = deeper), clipped, rescued, weight (summed gradient weight of the rescued tokens).
        ``runs``: only these runs (``sweep/run_id``). Each file is read once (by load_runs, with the run's other
        logs); its problems become issues when a call first asks for that run."""
        frames = []
        inc = self.included if runs is None else self.included[self.included["run"].isin(runs)]
        for rec in inc.itertuples():
            if rec.run not in self._bins:
                self._bins[rec.run] = _run_bins(RunDir(rec.path), rec.run)
            got = self._bins[rec.run]
            if got is None:
                continue
            frame, bad = got
            for kind, msg in bad:
                self._issue(Issue(rec.sweep, rec.run_id, kind, f"ratio_bins.jsonl: {msg}"))
            if frame is not None:
                frames.append(frame)
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
def _arrow_table(path: Path):
    """A JSON-lines file (plain or .gz) as a pyarrow Table, or None when pyarrow cannot parse all of it (a truncated
    or corrupt line, a field whose values mix types): the caller then reads it line by line (read_rows), which says
    what is wrong. pyarrow accepts NaN and Infinity, so a caller checks finiteness where it matters.

    pyarrow comes with ``datasets``; its JSON reader is 3-5x faster than json.loads on these files."""
    try:
        return pj.read_json(str(path))
    except (pa.ArrowInvalid, OSError, EOFError):
        return None


def _arrow_eval(path: Path):
    """The eval file as a pyarrow Table of its EVAL_COLUMNS, or None (:func:`_arrow_table`)."""
    table = _arrow_table(path)
    return None if table is None else table.select([c for c in EVAL_COLUMNS if c in table.column_names])


def _plain(t: pa.DataType, numeric: bool = False) -> bool:
    """A column type pandas builds from rows of dicts the same way (numbers, null; with not ``numeric``, booleans and
    text too)."""
    num = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)
    return num or (not numeric and (pa.types.is_boolean(t) or pa.types.is_string(t)))


def _metrics_table_frame(table) -> pd.DataFrame | None:
    """metrics.jsonl's rows as ``pd.DataFrame(rows)`` builds them, from pyarrow's table; None when the rows need the
    row-by-row reading of :func:`_steps_frame`: a field that is not a plain column (a list, an object), or a step
    or READ_COLUMNS field that is not a number or null, or holds a NaN or an infinity."""
    for f in table.schema:
        read = f.name == "step" or f.name in READ_COLUMNS
        if not _plain(f.type, numeric=read):
            return None
        if read and pa.types.is_floating(f.type):
            col = table[f.name]
            if pc.any(pc.or_(pc.is_nan(col), pc.is_inf(col))).as_py():
                return None
    return table.to_pandas()


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
        g = table.group_by(keys).aggregate([("correct", "count"), ("correct", "sum")])
        pid = g.schema.field("problem_id").type
        if (pa.types.is_integer(pid) or pa.types.is_string(pid)) and pa.types.is_integer(g.schema.field("step").type):
            # the usual file: ids as text and the sort done by pyarrow (the same order: UTF-8 bytes = code points)
            g = g.set_column(
                g.schema.get_field_index("problem_id"), "problem_id", pc.cast(g["problem_id"], pa.string())
            )
            g = g.sort_by([(k, "ascending") for k in keys]).to_pandas()
            g = g.rename(columns={"correct_count": "n", "correct_sum": "c"})
            g["c"] = g["c"].round().astype("int64")
            g["n"] = g["n"].astype("int64")
            g["step"] = g["step"].astype("int64")
            return g[[*keys, "n", "c"]], []
        g = g.to_pandas().rename(columns={"correct_count": "n", "correct_sum": "c"})
        problems: list[tuple[str, str]] = []
    else:
        df, problems = read_eval(path)
        g = df.groupby(keys, sort=False)["correct"].agg(n="size", c="sum").reset_index()
    g["problem_id"] = g["problem_id"].astype(str)
    g["c"] = g["c"].round().astype("int64")
    g["n"] = g["n"].astype("int64")
    return g.sort_values(keys, kind="stable").reset_index(drop=True)[[*keys, "n", "c"]], problems


# ---------------------------------------------------------------------------------------------- folders
RUN_FILES = ("config.yaml", "status.json", "metrics.jsonl")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,199}")
"""A sweep name or run id the analysis accepts from a run's config.yaml (they become output file names)."""
READ_COLUMNS = ("reward_mean", "entropy", "clip_frac_low", "clip_frac_high", "clip_frac", "rescue_frac",
                "pushout_frac", "response_len")  # fmt: skip
"""The metrics.jsonl fields the analysis reads: a NaN, an infinity or a non-number in one makes the run incomplete."""


def find_run_dirs(root: Path, max_depth: int = 6) -> list[Path]:
    """Run folders (a folder with config.yaml, status.json or metrics.jsonl) at any depth under ``root`` (or
    ``root`` itself), sorted by path; a run folder's subfolders are not searched. Folders whose name starts with
    ``_`` or ``.`` (scratch) are skipped."""

    def is_run(p: Path) -> bool:
        return any((p / f).exists() for f in RUN_FILES)

    out: list[Path] = []

    def walk(p: Path, depth: int) -> None:
        if is_run(p):
            out.append(p)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith(("_", ".")))
        except OSError:
            return
        for c in children:
            walk(c, depth + 1)

    if Path(root).is_dir():
        walk(Path(root), 0)
    return out


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


def _tensorboard_rows(path: Path) -> list[dict] | None:
    if not any(path.rglob("events.out.tfevents.*")):
        return None
    from experiments.openrlhf.tensorboard import rows_from_tensorboard

    return rows_from_tensorboard(path)


def _steps_frame(rows: list[dict], df: pd.DataFrame | None = None) -> tuple[pd.DataFrame, list[str]]:
    """(step frame, problems): READ_COLUMNS as floats; a value that is not a finite number is a problem. ``df``: the
    rows' frame already built (:func:`_metrics_table_frame`, whose READ_COLUMNS hold only finite numbers and nulls;
    ``rows`` is then not read)."""
    problems = []
    checked = df is not None
    df = pd.DataFrame(rows) if df is None else df
    for col in READ_COLUMNS:  # from the rows themselves: a NaN written as such is bad, a missing value (null) is not
        if col not in df.columns or checked:
            continue
        if df[col].dtype.kind in "iuf" and np.isfinite(df[col].to_numpy(dtype=np.float64)).all():
            continue  # every row has a finite number (no null, bool or string): nothing to look at row by row
        bad = [r.get("step") for r in rows if r.get(col) is not None and not _finite_number(r[col])]
        if bad:
            problems.append(f"{col}: {len(bad)} value(s) not a finite number (first at step {bad[0]})")
    if "step" not in df.columns:
        return pd.DataFrame(), ["no step field"] if rows else []
    step = pd.to_numeric(df["step"], errors="coerce")
    problems += [f"{int(step.isna().sum())} row(s) with a non-numeric step"] if step.isna().any() else []
    df = df[step.notna()].astype({"step": "int64"})
    for col in df.columns:
        if col == "step":
            continue
        if col in READ_COLUMNS:
            if df[col].dtype != np.float64:
                df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        elif df[col].dtype == object:
            conv = pd.to_numeric(df[col], errors="coerce")
            if conv.notna().sum() == df[col].notna().sum():  # all values numeric (None -> NaN)
                df[col] = conv
    if "clip_frac" not in df.columns and {"clip_frac_low", "clip_frac_high"} <= set(df.columns):
        df["clip_frac"] = df["clip_frac_low"] + df["clip_frac_high"]
    return df, problems


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _as_int(v) -> int | None:
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else None


def sweep_members(
    runs: pd.DataFrame, sweeps_dir: Path | None, presets_dir: Path | None = None, expanded: dict | None = None
) -> tuple[dict[str, list[dict]], list[str]]:
    """{config hash: [{sweep, arm, point, seed, baseline, preset, run_id}]}: every sweep file in ``sweeps_dir`` that
    contains a config, expanded with the presets the runs were made with; and notes on sweep files that failed.

    Hashes are today's ``RunConfig.run_hash()``; a run folder is matched through its config.yaml read by today's code
    (``runs["config_hash"]``), so a field added since the run was made (with its default) does not hide it."""
    from experiments.sweep import SweepError, expand, load_sweep

    out: dict[str, list[dict]] = {}
    notes: list[str] = []
    if sweeps_dir is None or not Path(sweeps_dir).is_dir():
        return out, notes
    presets = sorted({p for p in runs.get("meta.preset", pd.Series(dtype=object)).dropna() if isinstance(p, str)})
    root = f"{Path(sweeps_dir).resolve().parent}/"  # notes name files from the repo, wherever it is checked out

    def why(e: Exception) -> str:
        return str(e).replace(root, "")

    for path in sorted(Path(sweeps_dir).glob("*.yaml")):
        try:
            sweep = load_sweep(path)
        except SweepError as e:
            notes.append(f"{path.stem}: not expanded: {why(e)}")
            continue
        if sweep.status == "template":  # placeholders: no run belongs to it until it is filled in
            continue
        for preset in presets:
            if sweep.preset_only and preset not in sweep.presets:  # its runs exist only on its own preset(s)
                continue
            try:
                specs = expand(sweep, preset=preset, presets_dir=presets_dir)
            except (SweepError, ValueError) as e:
                notes.append(f"{path.stem} (preset {preset}): not expanded: {why(e)}")
                continue
            if expanded is not None:  # make_all's expected runs reuse it (analysis.make_all.expected_runs)
                expanded[(path.resolve(), preset, presets_dir)] = [(r.meta["sweep"], r.run_id) for r in specs]
            for r in specs:
                m = {k: r.meta[k] for k in ("sweep", "arm", "point", "seed", "baseline", "preset")}
                out.setdefault(r.config.run_hash(), []).append(m | {"run_id": r.run_id})
    return out, notes


def load_runs(
    root: str | Path = RUNS_ROOT,
    *,
    sweeps: list[str] | None = None,
    states: tuple[str, ...] = DONE_ONLY,
    sweeps_dir: str | Path | None = None,
    presets_dir: str | Path | None = None,
    pool: Executor | None = None,
    cache: str | Path | None = None,
) -> RunSet:
    """Load every run folder under ``root``, each config once.

    Args:
        root: a results folder (``<root>/<sweep>/<run_id>/``, copies at any depth included), one sweep folder, or one
            run folder.
        sweeps: keep only these sweep names (None: all).
        states: run states whose data enter ``steps`` and the eval frames (e.g. ``("done", "running")`` to look
            at live runs); the rest are listed in ``runs`` with ``included = False`` and in ``issues``.
        sweeps_dir: sweep files (default: the repo's sweeps/); a run belongs to every sweep whose file has its
            config, besides the sweep its own config.yaml names. presets_dir: their presets (default sweeps/presets).
        pool: an executor (:func:`analysis.parallel.worker_pool`) that reads each included run's metrics and eval
            files, one task per run; None reads them here, one after another. Either way the result (issues in
            their order included) is the same.
        cache: a folder (:func:`log_cache_dir`) keeping each run's parsed logs, keyed by the files' bytes and the
            reading code (:func:`log_key`): a rerun on unchanged runs skips the parsing. None: no cache.

    Identity: a run is its config hash, recomputed from its config.yaml by today's RunConfig (``meta.run_hash`` when
    that fails; :func:`experiments.rundir.stored_identity`). A folder whose recorded hash differs from what its
    identity scheme gives today was made by older code: ``legacy``. Folders holding the same
    config are one run: the first done-and-complete one (current before legacy, its own sweep's folder first, then
    by path) counts, the others are reported as ``copy`` issues and excluded. A done run whose metrics stop short of
    ``train.steps``, whose last eval is not at its last step, or whose metrics hold a value that is not a finite
    number is ``incomplete``: reported and excluded from every frame.
    """
    root = Path(root)
    sweeps_dir = Path(sweeps_dir) if sweeps_dir is not None else REPO_ROOT / "sweeps"
    issues: list[Issue] = []

    def raise_issue(sweep, run_id, kind, msg):
        it = Issue(sweep, run_id, kind, msg)
        issues.append(it)
        warnings.warn(str(it), RunWarning, stacklevel=3)

    pool = pool if pool is not None else InlinePool()
    cache = str(cache) if cache is not None else None
    # one task per folder (config, status, identity, logs), in the pool's workers; the issues raised in folder order
    paths, entries = [str(p) for p in find_run_dirs(root)], []
    while len(entries) < len(paths) and not ready(pool):  # its workers are starting: read folders here meanwhile
        entries.append(_read_folder(paths[len(entries)], str(root), tuple(states), sweeps, cache))
    tasks = [pool.submit(_read_folder, p, str(root), tuple(states), sweeps, cache) for p in paths[len(entries) :]]
    entries += [t.result() for t in tasks]

    records, frames, counts, bins = [], {}, {}, {}
    for rec, pending, logs in entries:
        for it in pending:
            raise_issue(*it)
        if rec is None:
            continue
        if logs is not None:
            rec, steps, c, run_bins, read_issues = logs
            for it in read_issues:
                raise_issue(*it)
            if steps is not None:
                frames[rec["run"]] = steps
            if c is not None:
                counts[rec["run"]] = c
            if rec["included"]:
                bins[rec["run"]] = run_bins
        records.append(rec)

    runs = pd.DataFrame(records)
    if not len(runs):
        runs = pd.DataFrame(
            {
                c: pd.Series(dtype=object)
                for c in (
                    "run",
                    "folder",
                    "path",
                    "hash",
                    "sweep",
                    "run_id",
                    "state",
                    "arm",
                    "label",
                    "seed",
                    "point",
                    "problem",
                )
            }  # fmt: skip
            | {"included": pd.Series(dtype=bool)}
        )
    _dedupe(runs, raise_issue)
    keep = set(runs.loc[runs["included"], "run"])
    expansions: dict = {}
    members, notes = _members(runs, sweeps_dir if sweeps_dir.is_dir() else None, presets_dir, expansions)
    step_frames = [f for run, f in frames.items() if run in keep]
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame({"run": [], "step": []})
    eval_files = {run: RunDir(p).eval_path for run, p in zip(runs["run"], runs["path"]) if run in keep}
    eval_files = {r: p for r, p in eval_files.items() if p.exists()}
    rs = RunSet(root, runs.reset_index(drop=True), steps, issues, members, notes, _eval_files=eval_files,
                expansions=expansions, _bins={r: b for r, b in bins.items() if r in keep})  # fmt: skip
    parts = [c for r, c in counts.items() if r in keep and c is not None and len(c)]
    cols = {c: pd.Series(dtype=object) for c in COUNT_KEYS} | {"n": pd.Series(dtype="int64")}
    rs._counts = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(cols | {"c": cols["n"]})
    for col in ("run", "benchmark", "decoding"):  # a few distinct strings over ~10^6 rows: filters and groupbys on
        if len(rs._counts):  # codes, not strings (categories sorted, so every groupby keeps the string order)
            rs._counts[col] = rs._counts[col].astype("category")
    return rs


def _read_folder(path: str, root: str, states: tuple, sweeps, cache: str | None) -> tuple:
    """One task of :func:`load_runs` (in a worker process, or here): one run folder's record, the issues found in
    its config and status as (sweep, run_id, kind, message), and, for an included run, what :func:`_read_logs`
    returns; (None, issues, None) for a folder that is skipped."""
    path, root = Path(path), Path(root)
    pending: list[tuple] = []
    issue = lambda *it: pending.append(it)  # noqa: E731
    rel = path.relative_to(root).as_posix() if path != root else path.name
    sweep_dir = path.parent.name if path != root else "adhoc"
    rd = RunDir(path)
    try:
        config = rd.read_config()
        if config is None:
            issue(sweep_dir, path.name, "no_config", "no config.yaml; folder skipped")
            return None, pending, None
    except RunFolderError as e:
        issue(sweep_dir, path.name, "bad_config", f"config.yaml unreadable ({e}); folder skipped")
        return None, pending, None
    meta = config.pop("meta", None)
    meta = meta if isinstance(meta, dict) else {}
    config.pop("preset", None)
    sweep = meta.get("sweep") if meta.get("sweep") is not None else sweep_dir
    run_id = meta.get("run_id") if meta.get("run_id") is not None else path.name
    bad_name = next((f"{k}={v!r}" for k, v in (("sweep", sweep), ("run_id", run_id))
                     if not isinstance(v, str) or not SAFE_NAME.fullmatch(v)), None)  # fmt: skip
    if bad_name:
        issue(sweep_dir, path.name, "bad_meta",
              f"{rel}/config.yaml meta.{bad_name} is not valid (allowed: letters, digits and _.+-, not first); "
              "folder skipped")  # fmt: skip
        return None, pending, None
    if sweeps is not None and sweep not in sweeps:
        return None, pending, None
    status = rd.status()
    state = "missing" if status is None else str(status.get("state"))
    if state == "missing":
        issue(sweep, run_id, "no_status", "no status.json (never started, or not a run folder)")
    elif state == "bad":
        issue(sweep, run_id, "bad_status", f"{status.get('problem')}; excluded")
    elif state in ("running", "failed", "cancelled"):
        err = status.get("error")
        excl = "" if state in states else "; excluded"
        issue(sweep, run_id, state, f"state {state}" + (f": {err}" if err else "") + excl)

    flat = flatten(config)
    try:  # identity: the config as today's code reads it (what the sweep files' expansions are matched against)
        ident = stored_identity({**config, "meta": meta}, f"{rel}/config.yaml")
    except RunFolderError as e:
        issue(sweep, run_id, "bad_config", f"{e}; skipped")
        return None, pending, None
    config_hash, run_hash = ident.recomputed, ident.run_hash
    point = meta.get("point") if isinstance(meta.get("point"), dict) else {}
    arm = str(meta.get("arm") or flat.get("loss.rule", "run"))
    seed = meta.get("seed", flat.get("seed"))
    rec = {
        "run": f"{sweep}/{run_id}",
        "folder": rel,
        "hash": run_hash,
        "config_hash": config_hash,
        "legacy": ident.legacy,
        "git_commit": meta.get("git_commit"),
        "sweep": sweep,
        "run_id": run_id,
        "path": str(path),
        "state": state,
        "included": state in states,
        "arm": arm,
        "label": make_label(arm, point),
        "seed": seed,
        "baseline": meta.get("baseline"),
        "point": dict(point),
        "error": (status or {}).get("error"),
        "problem": "",
        **flat,
        **{f"meta.{k}": v for k, v in flatten(meta).items() if k not in ("sweep", "arm", "seed", "baseline")},
    }
    if not rec["included"]:
        return rec, pending, None
    return rec, pending, _read_logs(rec, str(path), cache)


def _read_logs(
    rec: dict, path: str, cache: str | None = None, key: str | None = None
) -> tuple[dict, pd.DataFrame | None, pd.DataFrame | None, tuple | None, list[tuple]]:
    """One task of :func:`load_runs` (run in a worker process or here): read one included run's logs. Returns the
    record (updated as :func:`_read_run` does), its step frame and eval counts (None when absent or excluded), its
    ratio bins (:func:`_run_bins`) and the issues found, as (sweep, run_id, kind, message) in the order found.
    With ``cache`` (a folder), the result is kept there under ``key`` (:func:`log_key`, computed when not given)."""
    rd = RunDir(Path(path))
    if cache is not None and key is None:
        key = log_key(rec, rd)
    if cache is not None and key is not None:
        hit = _cache_get(Path(cache), key)
        if hit is not None:
            return _restore(rec, hit)
    frames, counts, found = {}, {}, []
    _read_run(rec, rd, frames, counts, lambda *it: found.append(it))
    bins = _run_bins(rd, rec["run"]) if rec["included"] else None
    out = rec, frames.get(rec["run"]), counts.get(rec["run"]), bins, found
    if cache is not None and key is not None:
        _cache_put(Path(cache), key, ({k: rec[k] for k in READ_UPDATES if k in rec}, *out[1:]))
    return out


def _restore(rec: dict, hit: tuple):
    updates, *rest = hit
    return {**rec, **updates}, *rest


def _run_bins(rd: RunDir, run: str) -> tuple[pd.DataFrame | None, list[tuple[str, str]]] | None:
    """One run's ratio_bins.jsonl summed over its steps, per side and bin (a frame of :meth:`RunSet.ratio_bins`), and
    the problems read_rows found; None when the run has no such file."""
    path = rd.log_path("ratio_bins.jsonl")
    if not path.exists():
        return None
    table = _arrow_table(path)
    sums = _bin_sums(table) if table is not None else None
    if sums is not None:  # the usual file: every row's lists of one length, summed by numpy
        first, bad = {k: table[k][0].as_py() for k in ("delta", "executor")}, []
    else:  # anything else, row by row
        rows, bad = read_rows(path)
        if not rows:
            return None, bad
        first = rows[0]
        sums = {
            side: {w: [sum(col) for col in zip(*(r[f"{side}_{w}"] for r in rows))] for w in BIN_FIELDS}
            for side in ("pos", "neg")
        }
    frames = [
        pd.DataFrame(
            {"run": run, "delta": first["delta"], "executor": first["executor"], "side": side}
            | {"bin": range(len(sums[side]["clipped"]))}
            | sums[side]
        )
        for side in ("pos", "neg")
    ]
    return pd.concat(frames, ignore_index=True), bad


def _bin_sums(table) -> dict[str, dict[str, list]] | None:
    """{side: {field: per-bin sums over the rows}} of a ratio_bins table, as the row-by-row sums of :func:`_run_bins`
    give them (numpy adds row after row down a column, the order ``sum`` uses); None when a row lacks a field, a list
    differs in length or a value is not a finite number (the row-by-row reading handles those)."""
    if not len(table) or not {"delta", "executor"} <= set(table.column_names):
        return None
    out: dict[str, dict[str, list]] = {}
    width = None
    for side in ("pos", "neg"):
        out[side] = {}
        for w in BIN_FIELDS:
            name = f"{side}_{w}"
            if name not in table.column_names or table[name].null_count:
                return None
            col = table[name].combine_chunks()
            vt = col.type.value_type if pa.types.is_list(col.type) else None
            if vt is None or not (pa.types.is_integer(vt) or pa.types.is_floating(vt)):
                return None
            lengths = pc.list_value_length(col).to_numpy()
            width = lengths[0] if width is None else width
            flat = col.flatten()
            if (lengths != width).any() or flat.null_count:
                return None
            values = flat.to_numpy().reshape(len(table), width)
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                return None
            out[side][w] = values.sum(axis=0).tolist() if len(values) else []
    return out


# ---------------------------------------------------------------------------------------------- parsed-log cache
READ_INPUTS = ("sweep", "run_id", "run", "state", "backend", "train.steps", "eval.n_prompts")
"""The record fields :func:`_read_run` reads (besides the files): part of the cache key."""
READ_UPDATES = ("n_steps", "last_step", "has_eval", "metrics_source", "state", "included", "problem")
"""The record fields :func:`_read_run` sets: what a cache entry restores."""
CACHE_SOURCES = ("analysis/load.py", "experiments/rundir.py")
"""The code that turns a run's files into frames: any change to it makes every cache entry stale."""


def log_cache_dir() -> Path:
    """The parsed-log cache of make_all: ``<cache_dir()>/analysis`` (``$NSR_CACHE_DIR``, else the repo's cache/)."""
    return cache_dir() / "analysis"


_CODE_KEY: list[str] = []


def _code_key() -> str:
    if not _CODE_KEY:
        h = hashlib.sha256()
        for rel in CACHE_SOURCES:
            h.update(rel.encode() + b"\0" + (REPO_ROOT / rel).read_bytes() + b"\0")
        h.update(f"{pd.__version__} {pa.__version__} {np.__version__}".encode())
        _CODE_KEY.append(h.hexdigest())
    return _CODE_KEY[0]


def log_key(rec: dict, rd: RunDir) -> str | None:
    """sha256 over the reading code (:data:`CACHE_SOURCES`, the pandas / pyarrow / numpy versions), the record fields
    the reading uses and the bytes of metrics.jsonl, the eval file and ratio_bins.jsonl(.gz); None (not cached) for a
    run without metrics.jsonl (its metrics come from TensorBoard event files, read each time)."""
    if not rd.metrics_path.is_file():
        return None
    h = hashlib.sha256(_code_key().encode())
    fields = {k: rec.get(k) for k in READ_INPUTS}
    h.update(json.dumps(fields, sort_keys=True, default=repr).encode())
    for p in (rd.metrics_path, rd.eval_path, rd.log_path("ratio_bins.jsonl")):
        h.update(b"\0" + p.name.encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _cache_file(cache: Path, key: str) -> Path:
    return cache / _code_key()[:16] / f"{key}.pkl.z"


def _cache_get(cache: Path, key: str):
    """The entry, or None when it is absent or unreadable (a partial or foreign file is a miss, never an error)."""
    try:
        return pickle.loads(zlib.decompress(_cache_file(cache, key).read_bytes()))
    except Exception:  # noqa: BLE001  (any damage: recompute)
        return None


def _cache_put(cache: Path, key: str, value) -> None:
    """Write the entry atomically (a crash leaves the old state); a cache that cannot be written is skipped."""
    path = _cache_file(cache, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_bytes(zlib.compress(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), 1))
    except OSError:
        pass


def prune_log_cache(cache: Path) -> int:
    """Remove the entries made by other versions of the reading code (their key folder differs); returns how many
    folders were removed."""
    cache = Path(cache)
    if not cache.is_dir():
        return 0
    gone = 0
    for d in cache.iterdir():
        if d.is_dir() and d.name != _code_key()[:16] and re.fullmatch(r"[0-9a-f]{16}", d.name):
            shutil.rmtree(d, ignore_errors=True)
            gone += 1
    return gone


def _read_run(rec: dict, rd: RunDir, frames: dict, counts: dict, issue) -> None:
    """Read one included run's metrics and eval counts into ``frames`` / ``counts``; mark it incomplete (excluded,
    with the reason in ``rec['problem']``) when its logs do not cover its configured steps or hold bad numbers."""
    sweep, run_id, run = rec["sweep"], rec["run_id"], rec["run"]
    steps, problems = pd.DataFrame(), []
    table = _arrow_table(rd.metrics_path) if rd.metrics_path.exists() else None
    fast = _metrics_table_frame(table) if table is not None else None
    if fast is not None:  # the usual file: parsed whole by pyarrow, nothing to report line by line
        steps, problems = _steps_frame([], fast)
    elif rd.metrics_path.exists():
        rows, probs = read_rows(rd.metrics_path)
        for kind, msg in probs:
            issue(sweep, run_id, kind, f"metrics.jsonl: {msg}")
        steps, problems = _steps_frame(rows)
    else:
        tb = _tensorboard_rows(rd.path)
        if tb is None:
            issue(sweep, run_id, "no_metrics", "no metrics.jsonl and no TensorBoard events")
        else:
            steps, problems = _steps_frame(tb)
            rec["metrics_source"] = "tensorboard"
    if len(steps):
        dup = steps["step"].duplicated(keep="last")
        if dup.any():
            issue(sweep, run_id, "duplicate_steps", f"{int(dup.sum())} repeated step(s); kept the last of each")
            steps = steps[~dup]
        steps = steps.sort_values("step", kind="stable")
    rec["n_steps"] = len(steps)
    rec["last_step"] = int(steps["step"].max()) if len(steps) else -1
    want = _as_int(rec.get("train.steps")) if rec.get("backend", "tiny") == "tiny" else None
    if rec["state"] == "done" and want is not None and len(steps) and (len(steps) < want or rec["last_step"] < want):
        problems.append(f"{len(steps)} of {want} metric rows (last step {rec['last_step']})")
    if rec["state"] == "done" and not len(steps) and rd.metrics_path.exists():
        problems.append("metrics.jsonl has no rows")
    eval_path = rd.eval_path
    rec["has_eval"] = eval_path.exists()
    c = None
    if not rec["has_eval"]:
        if rec["state"] == "done":
            issue(sweep, run_id, "no_eval", "no eval.jsonl(.gz): pass@k columns are empty for this run")
            if want is not None and (_as_int(rec.get("eval.n_prompts")) or 0) > 0:
                problems.append("final eval missing (no eval file)")
    else:
        try:
            c, bad = count_eval(eval_path)
        except (OSError, ValueError) as e:
            issue(sweep, run_id, "bad_eval", f"{eval_path.name} unreadable: {e}")
            problems.append("eval file unreadable")
            c, bad = None, []
        for kind, msg in bad:
            issue(sweep, run_id, kind, f"{eval_path.name}: {msg}")
        if c is not None and rec["state"] == "done":
            problems += _eval_problems(c, rec["last_step"] if want is not None else None)
    if problems and rec["state"] == "done":
        rec["state"], rec["included"] = "incomplete", False
        rec["problem"] = "; ".join(problems)
        issue(sweep, run_id, "incomplete", f"{rec['problem']}; excluded from every table, figure and claim")
        return
    if len(steps):
        steps.insert(0, "run", run)
        frames[run] = steps
    if c is not None:
        c.insert(0, "run", run)
        counts[run] = c


def _eval_problems(c: pd.DataFrame, last_step: int | None) -> list[str]:
    """A done run's eval counts must end with a full evaluation at its last training step."""
    if not len(c):
        return ["eval file has no rows"]
    out = []
    step, dec, n = c["step"].to_numpy(), c["decoding"].to_numpy(dtype=object), c["n"].to_numpy()
    final = int(step.max())
    if last_step is not None and final < last_step:
        out.append(f"final eval missing (last eval at step {final}, last metric step {last_step})")
    first, fin = step == step.min(), step == final
    for d in sorted(set(dec[first])):
        g, f = first & (dec == d), fin & (dec == d)
        if f.sum() < g.sum() or (f.any() and int(n[f].sum()) < int(n[g].sum())):
            out.append(f"final eval cut short ({d}: {int(n[f].sum())} of {int(n[g].sum())} samples)")
    return out


def _dedupe(runs: pd.DataFrame, issue) -> None:
    """One folder per config hash: keep the first done-and-included folder (current code before legacy, a folder at
    <sweep>/<run_id> of its own meta first, then by path); every other folder with that hash is a ``copy``."""
    if not len(runs):
        runs["copy_of"] = pd.Series(dtype=object)
        return
    runs["copy_of"] = None
    canonical = runs["folder"] == runs["run"]
    order = runs.assign(_c=~canonical, _i=~runs["included"]).sort_values(["hash", "_i", "legacy", "_c", "folder"])
    for _, g in order.groupby("hash", sort=False):
        if len(g) < 2:
            continue
        keep = g.index[0]
        for i in g.index[1:]:
            runs.at[i, "copy_of"] = runs.at[keep, "folder"]
            if runs.at[i, "included"]:
                runs.at[i, "included"] = False
            runs.at[i, "state"] = f"copy ({runs.at[i, 'state']})"
            issue(runs.at[i, "sweep"], runs.at[i, "run_id"], "copy",
                  f"{runs.at[i, 'folder']} holds the same config (hash {runs.at[i, 'hash']}) as "
                  f"{runs.at[keep, 'folder']}; counted once, there")  # fmt: skip
    # a copy's folder name can repeat the kept run's key (a backup/ copy): give it its folder as the key
    dup_key = runs["run"].duplicated(keep=False) & runs["copy_of"].notna()
    runs.loc[dup_key, "run"] = runs.loc[dup_key, "folder"]


MEMBER_COLUMNS = ["run", "sweep", "run_id", "arm", "label", "seed", "baseline", "point", "preset", "in_file"]


def _members(
    runs: pd.DataFrame, sweeps_dir: Path | None, presets_dir=None, expanded: dict | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """One row per (sweep, included run): the sweep its config.yaml names, and every sweep file holding its config
    (arm, point, seed and baseline from that sweep file)."""
    inc = runs[runs["included"]] if len(runs) else runs
    by_hash, notes = sweep_members(inc, sweeps_dir, presets_dir, expanded) if len(inc) else ({}, [])
    rows = []
    for rec in inc.to_dict("records"):
        own = {k: rec[k] for k in ("run", "sweep", "run_id", "arm", "seed", "baseline", "point")}
        own["preset"] = rec.get("meta.preset")
        own["in_file"] = False  # its config.yaml names the sweep; today's sweep file may not hold the config any more
        mine = {own["sweep"]: own}
        for m in by_hash.get(rec["config_hash"], []):
            mine[m["sweep"]] = {"run": rec["run"], **m, "in_file": True}
        rows += list(mine.values())
    members = pd.DataFrame(rows, columns=[c for c in MEMBER_COLUMNS if c != "label"])
    members["label"] = [make_label(a, p) for a, p in zip(members["arm"], members["point"])]
    members = members[MEMBER_COLUMNS].sort_values(["sweep", "run_id"], kind="stable").reset_index(drop=True)
    _split_presets(members)
    return members, notes


def _split_presets(members: pd.DataFrame) -> None:
    """A sweep whose runs come from several presets (e.g. tiny and tiny-smoke in one results folder): the preset
    joins each run's grid point and label, so runs of different presets are never averaged or paired together."""
    for _, g in members.groupby("sweep"):
        if g["preset"].nunique(dropna=True) < 2:
            continue
        for i in g.index:
            point = members.at[i, "point"]
            if "preset" not in point and isinstance(members.at[i, "preset"], str):
                point = {**point, "preset": members.at[i, "preset"]}
                members.at[i, "point"] = point
                members.at[i, "label"] = make_label(members.at[i, "arm"], point)


def status_report(rs: RunSet, expected: dict[str, list[str]] | None = None) -> dict[str, dict[str, list[str]]]:
    """Per sweep: {"done": [...], "incomplete": [...], "running": [...], ..., "missing": [...]} run ids.

    ``done`` is every counted run of the sweep (``rs.members``, shared runs included wherever their folder is);
    the other states are the sweep's own folders that are not counted (copies are listed as ``copy``). ``expected``
    maps a sweep to the run ids its sweep file defines: an id whose config (the id's hash) has no folder anywhere
    is listed as missing."""
    out: dict[str, dict[str, list[str]]] = {}
    m = rs.members
    for sweep, g in m.groupby("sweep", sort=True) if len(m) else []:
        out.setdefault(sweep, {})["done"] = sorted(g["run_id"])
    runs = rs.runs
    rest = runs[~runs["included"]] if len(runs) else runs
    for rec in rest.itertuples(index=False):
        state = "copy" if str(rec.state).startswith("copy") else str(rec.state)
        out.setdefault(rec.sweep, {}).setdefault(state, []).append(rec.run_id)
    have = set(runs["config_hash"].dropna()) | set(runs["hash"].dropna()) if len(runs) else set()
    for sweep, ids in (expected or {}).items():
        out.setdefault(sweep, {})
        listed = {i for v in out[sweep].values() for i in v}
        missing = sorted(i for i in ids if i not in listed and i.rsplit("-", 1)[-1] not in have)
        if missing:
            out[sweep]["missing"] = missing
    return {sw: {st: sorted(v) for st, v in sorted(states.items())} for sw, states in sorted(out.items())}
