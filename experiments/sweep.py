"""Sweep files: declarative grids, one per paper table or figure, expanded by a pure function into runs.

    from experiments.sweep import expand, resolve_run
    runs = expand("sweeps/delta.yaml", preset="tiny")      # list[RunSpec], every config validated
    spec = resolve_run("delta", "nsr-delta0.2-s0-4e647725")  # exactly the config the grid runs

Commands that use it: ``python -m slurm.submit SWEEP [--preset P] --dry-run`` lists the runs,
``python -m experiments.run --sweep SWEEP --run RUN_ID`` runs one, ``python -m slurm.status SWEEP``.

Format (every key but ``arms`` or ``grid`` optional; dotted keys are RunConfig fields, as ``key=value``)::

    name: delta                  # folder under results/runs/ (default: the file name)
    description: ...
    preset: qwen2.5-math-7b-dapo # sweeps/presets/<name>.yaml; a list is a preset axis; --preset P replaces it
    base: {loss.eps_low: 0.2}    # overrides applied to every run
    grid:                        # Cartesian axes for every arm: {dotted key: [values]}
      loss.delta: [0.1, 0.2]
    factors:                     # named bundles for every arm: {factor: {label: {dotted key: value}}}
      base: {dapo: {loss.level: token}, gspo: {loss.level: sequence, loss.eps_low: 3.0e-4}}
    arms:                        # named arms: overrides, plus the arm's own grid / factors
      hard: {loss.rule: hard}
      nsr: {loss.rule: nsr, grid: {loss.delta: [0.05, 0.2]}}
    seeds: [0, 1, 2]             # the preset's `preset: {max_seeds: N}` keeps the first N
    tie: {sft.seed: seed}        # fields set to each run's seed (one warm start per seed: pairs share it)
    baseline: hard               # the arm the analysis pairs differences against
    status: ready                # default; `template` (placeholder values): --dry-run lists it, nothing runs it
    preset_only: false           # true: the runs pin the preset's model and task (a stage on a real model), so
                                 # --preset P other than the file's own is refused

Run = preset < base < arm < (factor bundles, grid values) < seed (and the fields ``tie`` sets to it), in that
precedence. A key set by an arm must not
also be an axis of that arm, and axes must not share keys (the value would be ambiguous); ``seed`` is set only by
``seeds``. Without ``arms`` there is one arm, ``default``.

Each run gets ``run_id`` = readable name + ``-`` + ``cfg.run_hash()``, e.g. ``gspo-nsr-s0-1a2b3c4d`` (preset
axis, sweep factor labels, arm, the arm's factor labels, grid values, seed; a numeric label reads name+value), and
``meta`` = ``{sweep, arm, point, seed, baseline, preset}``, where ``point`` maps each axis of the run to its value:
``{"loss.delta": 0.2}`` for a grid key, ``{"base": "gspo"}`` for a factor, ``{"preset": name}`` for a preset axis.
Pairing rule for the analysis: a run is compared with the baseline arm's run of the same seed whose point agrees on
the baseline's own axes (a baseline without axes pairs with every point; preset is in the point when it is an axis).

Every error (unknown key, a key given twice, wrong type or range, unknown preset or rule, empty grid, duplicate run)
is a
:class:`SweepError` naming the file, the key and the allowed values, raised before anything runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.config import ConfigError, RunConfig, apply_overrides, from_dict, split_meta
from experiments.rundir import REPO_ROOT, RUNS_ROOT, RunDir, RunFolderError
from experiments.yamlio import read_yaml

SWEEPS_DIR = REPO_ROOT / "sweeps"
"""The sweep files (data, not code: ``sweeps/*.yaml``) and their presets (``sweeps/presets/*.yaml``)."""
PRESETS_DIR = SWEEPS_DIR / "presets"
TOP_KEYS = (
    "name",
    "description",
    "preset",
    "base",
    "grid",
    "factors",
    "arms",
    "seeds",
    "tie",
    "baseline",
    "status",
    "preset_only",
)
TIE_SOURCES = ("seed",)
"""What a ``tie:`` entry may copy: today only the run's seed (``tie: {sft.seed: seed}``: one warm start per seed)."""
STATUSES = ("ready", "template")
"""``status:`` of a sweep file: ready (default) runs; template (placeholder values, e.g. a confirmatory grid before
the stage that sizes it) is listed by ``--dry-run`` but never run (:func:`check_ready`)."""
ARM_KEYS = ("grid", "factors")
PRESET_KEYS = ("max_seeds", "slurm")
DEFAULT_ARM = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class SweepError(ConfigError):
    """A bad sweep file or preset; the message names the file, the key and the allowed values."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: what ``experiments.run.run`` needs, and where it came from."""

    config: RunConfig
    run_id: str
    sweep: str
    meta: dict[str, Any]
    """{sweep, arm, point, seed, baseline, preset}: stored in the run's config.yaml for the analysis."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The dotted overrides applied over the preset: ``python -m experiments.run <preset> k=v ...`` equals it."""
    preset_path: Path | None = None
    slurm: dict[str, Any] = field(default_factory=dict)
    """The preset's own SLURM resources (its ``preset: {slurm: {...}}``; checked and used by slurm/submit.py)."""


@dataclass(frozen=True)
class Sweep:
    """A parsed, structurally checked sweep file (values are checked per run by :func:`expand`)."""

    path: Path
    name: str
    description: str
    presets: tuple[str, ...]
    base: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    """arm label -> {"set": overrides, "grid": {key: [values]}, "factors": {name: [(label, overrides)]}, "shared":
    names of the sweep-level factors}, with the sweep-level grid and factors merged in."""
    seeds: tuple[int, ...]
    baseline: str | None
    status: str = "ready"
    tie: dict[str, str] = field(default_factory=dict)
    """{dotted key: source}: the key takes each run's value of ``source`` (``seed``)."""
    preset_only: bool = False
    """The runs need the file's own preset(s): ``--preset`` naming another is refused."""


# ---------------------------------------------------------------- paths
def sweep_path(sweep: str | Path) -> Path:
    """``delta`` -> sweeps/delta.yaml; a path is returned as is. SweepError listing the sweeps if missing."""
    p = Path(sweep)
    if p.suffix not in (".yaml", ".yml") and not p.exists():
        p = SWEEPS_DIR / f"{sweep}.yaml"
    if not p.is_file():
        raise SweepError(f"{sweep}: no such sweep file; available: {', '.join(available(SWEEPS_DIR))}")
    return p


def available(folder: Path) -> list[str]:
    return sorted(p.stem for p in Path(folder).glob("*.yaml"))


def preset_file(preset: str, presets_dir: Path | None = None) -> Path:
    """A preset name (sweeps/presets/<name>.yaml) or a path to a RunConfig YAML."""
    folder = Path(presets_dir) if presets_dir else PRESETS_DIR
    if preset.endswith((".yaml", ".yml")) or "/" in preset:
        p = Path(preset)
    else:
        p = folder / f"{preset}.yaml"
    if not p.is_file():
        raise SweepError(f"preset={preset!r} not found; allowed: {', '.join(available(folder)) or '(none yet)'}")
    return p


# ---------------------------------------------------------------- parsing
def _read(path: Path, what: str) -> dict:
    """A sweep or preset file as a mapping (duplicate keys, an empty or binary file refused) or SweepError."""
    try:
        return read_yaml(path, what=what)
    except ConfigError as e:
        raise SweepError(str(e)) from None


def _where(path: Path, key: str) -> str:
    return f"{path}: {key}" if key else str(path)


def _mapping(path: Path, key: str, value, what: str = "a mapping") -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SweepError(f"{_where(path, key)}={value!r} is not valid; allowed: {what}")
    return value


def _label(path: Path, key: str, value) -> str:
    text = str(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not _NAME.fullmatch(text):
        raise SweepError(
            f"{_where(path, key)}: label {value!r} is not valid; allowed: letters, digits and _.+- (not first)"
        )
    return text


def _field_types() -> dict[str, Any]:
    """Every settable dotted key of RunConfig -> its type (leaves only, not sections)."""

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", tp

    return dict(walk(RunConfig, ""))


_FIELDS = _field_types()


def _check_key(path: Path, where: str, key) -> None:
    """A dotted key must name a RunConfig leaf field; ``seed`` comes from ``seeds`` only."""
    if key == "seed":
        raise SweepError(f"{_where(path, where)}: 'seed' is set by the top-level `seeds` list only")
    if isinstance(key, str) and key in _FIELDS:
        return
    key = str(key)
    section, _, leaf = key.rpartition(".")
    if key in {k.split(".")[0] for k in _FIELDS}:
        allowed = [k for k in _FIELDS if k.startswith(key + ".")]
        raise SweepError(f"{_where(path, where)}: {key!r} is a section; allowed: dotted keys {', '.join(allowed)}")
    siblings = [k for k in _FIELDS if k.rpartition(".")[0] == section] if section else []
    allowed = siblings or [k for k in _FIELDS if "." not in k] + sorted({k.split(".")[0] + ".*" for k in _FIELDS})
    extra = ", grid, factors" if where.startswith("arms.") and not section else ""
    raise SweepError(f"{_where(path, where)}: unknown key {key!r}; allowed: {', '.join(allowed)}{extra}")


def _overrides(path: Path, where: str, value) -> dict[str, Any]:
    out = _mapping(path, where, value, "a mapping of dotted RunConfig keys to values")
    for k in out:
        _check_key(path, where, k)
    return dict(out)


def _grid(path: Path, where: str, value) -> dict[str, list]:
    grid = _mapping(path, where, value, "a mapping {dotted key: [values]}")
    for k, vals in grid.items():
        _check_key(path, where, k)
        if not isinstance(vals, list) or not vals:
            raise SweepError(f"{_where(path, f'{where}.{k}')}={vals!r} is not valid; allowed: a non-empty list")
        if len({repr(v) for v in vals}) != len(vals):
            raise SweepError(f"{_where(path, f'{where}.{k}')}: repeated value in {vals!r}; allowed: distinct values")
    return dict(grid)


def _factors(path: Path, where: str, value) -> dict[str, list[tuple[Any, dict]]]:
    """{factor: [(label as written, overrides), ...]}; a numeric label stays a number in ``meta.point``."""
    factors = _mapping(path, where, value, "a mapping {factor: {label: {dotted key: value}}}")
    out = {}
    for name, options in factors.items():
        name = _label(path, where, name)
        options = _mapping(path, f"{where}.{name}", options, "a mapping {label: {dotted key: value}}")
        if not options:
            raise SweepError(f"{_where(path, f'{where}.{name}')} is empty; allowed: at least one labelled option")
        out[name] = []
        for label, ov in options.items():
            text = _label(path, f"{where}.{name}", label)
            out[name].append((label, _overrides(path, f"{where}.{name}.{text}", ov)))
    return out


def _axis_keys(grid: dict, factors: dict) -> list[tuple[str, str]]:
    """(dotted key, axis name) for every key an arm's axes set."""
    keys = [(k, f"grid.{k}") for k in grid]
    for name, options in factors.items():
        for k in sorted({k for _, ov in options for k in ov}):
            keys.append((k, f"factors.{name}"))
    return keys


def load_sweep(sweep: str | Path) -> Sweep:
    """Parse and structurally check a sweep file (no preset is read; :func:`expand` validates the runs)."""
    path = sweep_path(sweep)
    data = _read(path, "sweep")
    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        raise SweepError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(TOP_KEYS)}")
    name = _label(path, "name", data.get("name", path.stem))
    description = data.get("description", "")
    if not isinstance(description, str):
        raise SweepError(f"{path}: description={description!r} is not valid; allowed: a string")

    presets = data.get("preset")
    presets = [presets] if isinstance(presets, str) else presets
    if not isinstance(presets, list) or not presets or not all(isinstance(p, str) and p for p in presets):
        raise SweepError(f"{path}: preset={data.get('preset')!r} is not valid; allowed: a preset name or a list")
    if len(set(presets)) != len(presets):
        raise SweepError(f"{path}: preset: repeated name in {presets!r}; allowed: distinct presets")

    base = _overrides(path, "base", data.get("base"))
    grid = _grid(path, "grid", data.get("grid"))
    factors = _factors(path, "factors", data.get("factors"))
    if "arms" in data:
        raw_arms = _mapping(path, "arms", data["arms"], "a mapping {arm label: {dotted key: value, grid, factors}}")
        if not raw_arms:
            raise SweepError(f"{path}: arms is empty; allowed: at least one arm")
    elif "grid" in data or "factors" in data:
        raw_arms = {DEFAULT_ARM: {}}
    else:
        raise SweepError(f"{path}: no runs to make; allowed: an `arms` mapping and/or a `grid`")

    arms = {}
    for label, body in raw_arms.items():
        label = _label(path, "arms", label)
        body = dict(_mapping(path, f"arms.{label}", body, "a mapping {dotted key: value, grid, factors}"))
        a_grid = _grid(path, f"arms.{label}.grid", body.pop("grid", None))
        a_factors = _factors(path, f"arms.{label}.factors", body.pop("factors", None))
        sets = _overrides(path, f"arms.{label}", body)
        clash = sorted(set(a_factors) & set(factors))
        if clash:
            raise SweepError(f"{path}: arms.{label}.factors.{clash[0]} repeats the sweep factor; rename one")
        clash = sorted(set(a_grid) & set(grid))
        if clash:
            raise SweepError(f"{path}: arms.{label}.grid.{clash[0]} repeats a key of the sweep grid; keep one")
        merged_grid, merged_factors = {**grid, **a_grid}, {**factors, **a_factors}
        seen: dict[str, str] = {}
        for k, axis in _axis_keys(grid, {}) + _axis_keys(a_grid, {}) + _axis_keys({}, merged_factors):
            if k in seen:
                raise SweepError(f"{path}: arms.{label}: key {k!r} is set by both {seen[k]} and {axis}")
            if k in sets:
                raise SweepError(f"{path}: arms.{label}: key {k!r} is set by the arm and by its axis {axis}")
            seen[k] = axis
        arms[label] = {"set": sets, "grid": merged_grid, "factors": merged_factors, "shared": set(factors)}

    seeds = data.get("seeds", [0])
    ok = isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not ok or len(set(seeds)) != len(seeds):
        raise SweepError(f"{path}: seeds={seeds!r} is not valid; allowed: a non-empty list of distinct integers")
    tie = _mapping(path, "tie", data.get("tie"), "a mapping {dotted key: seed}")
    for k, src in tie.items():
        _check_key(path, "tie", k)
        if src not in TIE_SOURCES:
            raise SweepError(f"{path}: tie.{k}={src!r} is not valid; allowed: {', '.join(TIE_SOURCES)}")
        setters = [w for w, v in [("base", base), *((f"arms.{a}", sp["set"]) for a, sp in arms.items())] if k in v]
        setters += [f"arms.{a} (axis)" for a, sp in arms.items() if k in dict(_axis_keys(sp["grid"], sp["factors"]))]
        if setters:
            raise SweepError(f"{path}: tie.{k}: {k!r} is also set by {setters[0]}; allowed: set it in one place")
    baseline = data.get("baseline")
    if baseline is not None and baseline not in arms:
        raise SweepError(f"{path}: baseline={baseline!r} is not an arm; allowed: {', '.join(arms)}")
    status = data.get("status", "ready")
    if status not in STATUSES:
        raise SweepError(f"{path}: status={status!r} is not valid; allowed: {', '.join(STATUSES)}")
    preset_only = data.get("preset_only", False)
    if not isinstance(preset_only, bool):
        raise SweepError(f"{path}: preset_only={preset_only!r} is not valid; allowed: true, false")
    return Sweep(
        path, name, description, tuple(presets), base, arms, tuple(seeds), baseline, status, dict(tie), preset_only
    )


def check_ready(sweep: str | Path | Sweep) -> None:
    """SweepError unless the sweep may run: a ``status: template`` sweep has placeholder values (its header says
    what fills them) and runs only after the commit that fills them sets ``status: ready``."""
    sw = sweep if isinstance(sweep, Sweep) else load_sweep(sweep)
    if sw.status == "template":
        raise SweepError(
            f"{sw.path}: status: template: its values are placeholders (the file's header says what fills them), so "
            f"it is not run; allowed: list it with --dry-run, or set status: ready in the commit that fills it in"
        )


# ---------------------------------------------------------------- expansion
def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return re.sub(r"[^A-Za-z0-9_.+-]", "", str(value))


def _load_preset(preset: str, presets_dir: Path | None, source: Path) -> tuple[Path, dict, int | None, dict]:
    """(file, RunConfig fields, max_seeds, SLURM resources) of a preset."""
    try:
        path = preset_file(preset, presets_dir)
    except SweepError as e:
        raise SweepError(f"{source}: {e}") from None
    body, meta = split_meta(_read(path, "config"))
    options = _mapping(path, "preset", meta.get("preset"), f"a mapping with keys {', '.join(PRESET_KEYS)}")
    unknown = [k for k in options if k not in PRESET_KEYS]
    if unknown:
        raise SweepError(f"{path}: preset: unknown key {unknown[0]!r}; allowed: {', '.join(PRESET_KEYS)}")
    max_seeds = options.get("max_seeds")
    if max_seeds is not None and (not isinstance(max_seeds, int) or isinstance(max_seeds, bool) or max_seeds < 1):
        raise SweepError(f"{path}: preset.max_seeds={max_seeds!r} is not valid; allowed: an integer >= 1")
    slurm = options.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise SweepError(
            f"{path}: preset.slurm={slurm!r} is not valid; allowed: a mapping of SLURM resources "
            "(cpus_per_task, mem_gb, time_min, gpus_per_node: slurm/submit.py)"
        )
    return path, body, max_seeds, slurm


def expand(sweep: str | Path | Sweep, preset: str | None = None, presets_dir: Path | None = None) -> list[RunSpec]:
    """Every run of a sweep, validated: RunSpecs in a stable order (preset, arm, factors, grid, seed).

    ``preset`` replaces the sweep's preset (or preset axis); ``presets_dir`` is where names are looked up
    (default sweeps/presets). Raises SweepError on any bad value, before returning anything.
    """
    sw = sweep if isinstance(sweep, Sweep) else load_sweep(sweep)
    if sw.preset_only and preset and Path(preset).stem not in sw.presets:
        raise SweepError(
            f"{sw.path}: preset_only: its runs pin the model and task of its own preset, so preset={preset!r} is "
            f"refused; allowed: {', '.join(sw.presets)} (or no --preset)"
        )
    presets = (preset,) if preset else sw.presets
    runs: list[RunSpec] = []
    for preset_name in presets:
        ppath, body, max_seeds, slurm = _load_preset(preset_name, presets_dir, sw.path)
        pname = ppath.stem
        seeds = sw.seeds[:max_seeds] if max_seeds else sw.seeds
        for arm, spec in sw.arms.items():
            fnames = list(spec["factors"])
            gkeys = list(spec["grid"])
            f_opts = [spec["factors"][f] for f in fnames]
            g_vals = [spec["grid"][k] for k in gkeys]
            for f_choice in itertools.product(*f_opts):
                for g_choice in itertools.product(*g_vals):
                    point: dict[str, Any] = {"preset": pname} if len(presets) > 1 else {}
                    overrides = {**sw.base, **spec["set"]}
                    before = [pname] if len(presets) > 1 else []  # preset axis and sweep factors, then arm
                    after = []  # the arm's own factors and grid values
                    for fname, (label, ov) in zip(fnames, f_choice):
                        point[fname] = label
                        overrides.update(ov)
                        text = f"{fname}{_fmt(label)}" if isinstance(label, (int, float)) else label
                        (before if fname in spec["shared"] else after).append(text)
                    parts = [*before, arm, *after]
                    for k, v in zip(gkeys, g_choice):
                        point[k] = v
                        overrides[k] = v
                        parts.append(f"{k.rpartition('.')[2]}{_fmt(v)}")
                    for seed in seeds:
                        run = _make_run(sw, ppath, body, overrides, point, arm, seed, parts, pname)
                        runs.append(dataclasses.replace(run, slurm=dict(slurm)))
    _check_unique(sw.path, runs)
    return runs


def _make_run(sw: Sweep, ppath: Path, body: dict, overrides: dict, point: dict, arm: str, seed: int, parts, pname):
    name = "-".join([*parts, f"s{seed}"])
    overrides = {**overrides, "seed": seed, **{k: seed for k in sw.tie}}
    try:
        cfg = from_dict(apply_overrides(body, overrides))
    except ConfigError as e:
        raise SweepError(f"{sw.path}: run {name} (arm {arm}, preset {ppath}): {e}") from None
    meta = {"sweep": sw.name, "arm": arm, "point": dict(point), "seed": seed, "baseline": sw.baseline}
    meta["preset"] = pname
    return RunSpec(cfg, f"{name}-{cfg.run_hash()}", sw.name, meta, overrides, ppath)


def _check_unique(path: Path, runs: list[RunSpec]) -> None:
    by_id: dict[str, RunSpec] = {}
    by_hash: dict[str, RunSpec] = {}
    for r in runs:
        if r.run_id in by_id:
            raise SweepError(f"{path}: two runs have the id {r.run_id!r}; make the arms or labels distinct")
        h = r.config.run_hash()
        if h in by_hash:
            other = by_hash[h].run_id
            raise SweepError(
                f"{path}: runs {other!r} and {r.run_id!r} have the same config (hash {h}); "
                "allowed: each arm/point must change the config (check the arms' overrides)"
            )
        by_id[r.run_id], by_hash[h] = r, r


def _folder_identity(sweep_name: str, run_id: str) -> str | None:
    """The identity of the committed folder ``results/runs/<sweep>/<run_id>`` if there is one: its id may have been
    made under an earlier identity rule, and it names the run of its config."""
    folder = RUNS_ROOT / sweep_name / run_id
    if not (folder / "config.yaml").is_file() or not _NAME.fullmatch(run_id):
        return None
    try:
        return RunDir(folder).config_hash()
    except RunFolderError:
        return None


def resolve_run(sweep: str | Path, run_id: str, preset: str | None = None, presets_dir: Path | None = None) -> RunSpec:
    """The RunSpec of ``run_id`` in a sweep, exactly as :func:`expand` makes it; SweepError if it is not there.

    A run id depends on the preset (it ends in the config's hash, and the preset is most of the config). Without
    ``preset``, the sweep's own preset is tried first, then every preset file, so an id from a ``--preset tiny`` grid
    resolves without naming the preset (its RunSpec's ``meta["preset"]`` says which). With ``preset``, an id that is
    a run of another preset is refused naming that preset. The id of a folder made under an earlier identity rule
    (``results/runs/<sweep>/<id>/``) resolves to the run of its config.
    """
    runs = expand(sweep, preset=preset, presets_dir=presets_dir)
    identity = _folder_identity(runs[0].sweep, run_id) if runs else None

    def match(specs):
        return [r for r in specs if r.run_id == run_id or (identity and r.config.run_hash() == identity)]

    found = match(runs)
    if found:
        return found[0]
    tried = {r.meta["preset"] for r in runs}
    candidates = [None] if preset is not None else []  # with --preset: the sweep's own preset too
    candidates += list(available(Path(presets_dir) if presets_dir else PRESETS_DIR))
    for other in candidates:
        if other in tried:
            continue
        try:
            found = match(expand(sweep, preset=other, presets_dir=presets_dir))
        except SweepError:
            continue
        if not found:
            continue
        if preset is None:
            return found[0]
        owner = found[0].meta["preset"]
        fix = "drop --preset (it is the sweep's own preset)" if other is None else f"use --preset {owner}"
        raise SweepError(
            f"{sweep_path(sweep)}: {run_id!r} is a run of preset {owner!r}, not of --preset {preset} (a run id ends "
            f"in its config's hash, and the preset is part of the config); {fix}"
        )
    ids = [r.run_id for r in runs]
    close = difflib.get_close_matches(run_id, ids, n=5, cutoff=0.5)
    more = " ..." if len(ids) > 10 else ""
    hint = f"closest: {', '.join(close)}" if close else f"allowed: {', '.join(ids[:10])}{more}"
    where = f" with --preset {preset}" if preset else " under any preset"
    raise SweepError(f"{sweep_path(sweep)}: no run {run_id!r}{where} ({len(ids)} runs); {hint}")
