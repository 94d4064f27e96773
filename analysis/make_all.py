"""Rebuild every table and figure from the run folders; the only way results/tables and results/figures are made.

    python -m analysis.make_all                          # results/runs -> results/{tables,figures}, claims block
    python -m analysis.make_all --runs DIR --out DIR     # another results folder (README untouched unless --readme)
    python -m analysis.make_all --format png pdf         # also PDF figures for a paper

What it writes (idempotent: the same runs give byte-identical files), every file under --out:
    <out>/tables/<sweep>.md|.tex      arms x metrics, mean [95% t-interval] over seeds; paired differences vs baseline
                                      (<sweep>_sweep.md for a sweep named like a fixed table: main_sweep.md)
    <out>/tables/<sweep>_runs.csv     one row per run: every summary metric (analysis.summary)
    <out>/tables/main.md|.tex         the paper's reported numbers (results/paper/main.csv) next to the main sweep
    <out>/tables/claims.md            each claim: supports / contradicts / not reproduced at this scale / inconclusive
    <out>/tables/posthoc.md           the post-hoc readings (analysis/posthoc.yaml), labelled as such
    <out>/tables/status.md            per sweep: counted, incomplete, not done, copied and missing runs; load issues
    <out>/figures/<sweep>_dynamics.png, delta_sweep.png, judge_executor.png, theory_expected_weight.png, forest.png,
                  pass_at_k.png, clip_depth.png, screening.png (every arm of related / dgg minus hard)
    <out>/report.html                 one static page: claims, forest plot, every figure and table, run counts, issues
and rewrites the claims block of results/README.md between ``<!-- claims:start -->`` and ``<!-- claims:end -->``,
and every run count in it written as ``<!-- count:KEY -->N<!-- /count -->`` (keys: :data:`COUNT_KEYS`), so no run
count in that page is typed by hand.
The outputs of a sweep that has no counted run any more (its ``<sweep>_runs.csv`` is not rewritten) are removed.
Run folders' logs are read and figures drawn by worker processes (``--jobs``), and each run's parsed logs are kept
in a cache (``$NSR_CACHE_DIR/analysis``, else ``cache/analysis``; ``--no-cache``) keyed by the files' bytes and the
reading code: a rerun parses only new or changed runs. Neither changes a byte of the outputs.
A config is one run wherever its folders are (shared by sweeps, or copied): counted once per sweep that has it.
Runs that are incomplete, not done or copies are excluded from every table, figure and claim, with counts on
stderr and in status.md; runs of `make demo` (sweep ``demo``) are never tabled.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import warnings
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import SimpleNamespace

from analysis.parallel import JOBS_ENV, MAX_DEFAULT_JOBS, check_jobs, default_jobs, prestart, worker_pool

if __name__ == "__main__":  # the command line: the workers' fork server imports the analysis while this process does
    prestart(sys.argv[1:])

from analysis import claims as claims_mod
from analysis import collapse, figures, regime, tables
from analysis import report as report_mod
from analysis.load import (
    RUNS_ROOT,
    RunSet,
    RunWarning,
    find_run_dirs,
    load_runs,
    log_cache_dir,
    prune_log_cache,
    status_report,
)
from analysis.summary import eval_curves, summarize
from experiments.rundir import REPO_ROOT

OUT_ROOT = REPO_ROOT / "results"
README = REPO_ROOT / "results" / "README.md"
"""The page whose claims block make_all rewrites (results/README.md; README.md, the repo's door, links to it)."""
START, END = "<!-- claims:start -->", "<!-- claims:end -->"
COUNT = re.compile(r"<!-- count:([^ >]*) -->(.*?)<!-- /count -->", re.S)
"""A generated count in the README: ``<!-- count:KEY -->N<!-- /count -->``; make_all writes N."""
COUNT_KEYS = {
    "runs": "distinct runs counted (every table, figure and claim reads these)",
    "folders": "run folders found under the runs root (copies, incomplete and unfinished runs included)",
    "spikes": "counted runs with an entropy spike",
    "spike_runs": "those runs, as a list of `sweep/run_id`",
    "done:SWEEP": "counted runs of a sweep",
    "missing:SWEEP": "runs its sweep file defines that have no folder",
    "expected:SWEEP": "runs its sweep file defines",
}
"""The keys a README's count markers may use; SWEEP is the name of a sweep file."""
README_FIGURES = ("forest", "theory_expected_weight", "rescue_vs_decay_dynamics", "delta_sweep", "judge_executor")
"""Figures shown in the README block, when they exist."""
PARALLEL_MIN_RUNS = 32
"""make_all starts worker processes (jobs=None) only from this many run folders: below, starting them costs more
than they save."""
NOT_TABLED = ("demo",)
"""Sweeps make_all never tables: `make demo`'s runs (results/runs/demo), drawn by analysis.demo itself."""


def sealed_sweeps(regime_path: Path | None = None) -> dict[str, str]:
    """{sweep: stage section} of every stage of analysis/regime.yaml marked ``sealed: true``: a pre-registered stage
    whose runs no table, figure, claim or README block may read before all of them are done (no interim look)."""
    import yaml

    from analysis.regime import REGIME_FILE

    data = yaml.safe_load(Path(regime_path or REGIME_FILE).read_text()) or {}
    return {
        sec["sweep"]: name
        for name, sec in data.items()
        if isinstance(sec, dict) and sec.get("sealed") is True and isinstance(sec.get("sweep"), str)
    }


def still_sealed(sealed: dict[str, str], expected: dict, report: dict) -> dict[str, tuple[int, int]]:
    """{sweep: (done, planned)} of the sealed sweeps that some planned run of is not yet done (a sweep file that does
    not expand stays sealed, with planned 0)."""
    out = {}
    for sweep in sealed:
        planned = set(expected.get(sweep, []))
        done = set(report.get(sweep, {}).get("done", [])) & planned
        if not planned or done != planned:
            out[sweep] = (len(done), len(planned))
    return out


FIXED_TABLES = ("main", "claims", "posthoc", "status", "judge_collapse", "stage_a", "stage_a2", "stage_a3", "stage_r0")
"""Tables make_all always names so (tables/<name>.md): a sweep of one of these names gets tables/<sweep>_sweep.md."""


def table_name(sweep: str) -> str:
    """The file stem of a sweep's arm table: the sweep's name, or ``<sweep>_sweep`` where that is a fixed table's
    (the ``main`` sweep's arms would otherwise be overwritten by the paper table, tables/main.md)."""
    return f"{sweep}_sweep" if sweep in FIXED_TABLES else sweep


class OutputError(ValueError):
    """A path make_all would write is not usable (not a folder, not writable, or outside --out)."""


class ReadmeError(OutputError):
    """The README make_all would rewrite asks for a count it does not know."""


def check_readme_counts(readme: Path, sweeps_dir: Path | None = None) -> list[str]:
    """The count keys of ``readme``'s markers; ReadmeError naming the key and the allowed ones on any unknown key
    (checked before any run is read)."""
    from experiments.sweep import SWEEPS_DIR

    names = {p.stem for p in Path(sweeps_dir or SWEEPS_DIR).glob("*.yaml")}
    keys = [m.group(1) for m in COUNT.finditer(Path(readme).read_text())]
    for key in keys:
        kind, _, sweep = key.partition(":")
        ok = key in COUNT_KEYS if not sweep else f"{kind}:SWEEP" in COUNT_KEYS and sweep in names
        if not ok:
            raise ReadmeError(
                f"{readme}: count marker key {key!r} is not valid; allowed: {', '.join(COUNT_KEYS)} "
                f"(SWEEP one of {', '.join(sorted(names))})"
            )
    return keys


def run_counts(summary, rs: RunSet, report: dict, expected: dict) -> dict[str, str]:
    """Every count a README marker may ask for (:data:`COUNT_KEYS`), as the text make_all writes."""
    spiked = sorted(summary.loc[summary["entropy_spike"] > 0, "run"].unique()) if "entropy_spike" in summary else []
    out = {
        "runs": str(summary["run"].nunique()),
        "folders": str(len(rs.runs)),
        "spikes": str(len(spiked)),
        "spike_runs": ", ".join(f"`{r}`" for r in spiked) or "none",
    }
    for sweep in sorted(set(report) | set(expected)):
        states = report.get(sweep, {})
        out[f"done:{sweep}"] = str(len(states.get("done", [])))
        out[f"missing:{sweep}"] = str(len(states.get("missing", [])))
        out[f"expected:{sweep}"] = str(len(expected[sweep])) if sweep in expected else "?"  # not listable: a note
    return out


def fill_counts(text: str, counts: dict[str, str]) -> str:
    """``text`` with every count marker's value replaced by ``counts[key]`` (a key without a value, or a sweep whose
    runs cannot be listed (make_all's notes say why): "?")."""
    return COUNT.sub(lambda m: f"<!-- count:{m.group(1)} -->{counts.get(m.group(1), '?')}<!-- /count -->", text)


def check_out(out: Path) -> Path:
    """``out`` as a folder make_all can write into (created if missing); OutputError naming it otherwise."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file; allowed: a folder (it gets tables/, figures/ and report.html)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out}: not writable")
    return out


def write_text(path: Path, text: str, under: Path | None = None) -> Path:
    """Write only when the content changes (keeps mtimes, and git, quiet on an idempotent rerun). With ``under``,
    refuse (OutputError) a path that resolves outside that folder."""
    if under is not None:
        inside(path, under)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def inside(path: Path, under: Path) -> Path:
    """``path`` if it resolves inside ``under``; OutputError otherwise (a name taken from a run folder must never
    reach outside --out)."""
    if not Path(path).resolve().is_relative_to(Path(under).resolve()):
        raise OutputError(f"{path}: outside the output folder {under}; refused")
    return path


def expected_runs(rs: RunSet, sweeps_dir: Path | None = None, presets_dir: Path | None = None) -> tuple[dict, list]:
    """{sweep: [run ids its sweep file defines]} for the presets the sweep's runs were made with, and notes.

    A sweep file with no runs at all is expanded with its default preset. Sweep files that fail to expand are
    reported in the notes, never fatal (the tables of the runs that exist are still built)."""
    from experiments.sweep import SWEEPS_DIR, SweepError, expand

    folder = Path(sweeps_dir) if sweeps_dir else SWEEPS_DIR
    out, notes = {}, []
    runs = rs.members
    known = rs.expansions
    for path in sorted(folder.glob("*.yaml")):
        name = path.stem
        mine = runs[runs["sweep"] == name] if len(runs) else runs
        presets = sorted(mine["preset"].dropna().unique()) if "preset" in mine.columns else []
        try:  # the expansions load_runs made to match the runs (rs.expansions) are not made twice
            specs = [r for p in (presets or [None]) for r in known.get((path.resolve(), p, presets_dir)) or
                     [(x.sweep, x.run_id) for x in expand(path, preset=p, presets_dir=presets_dir)]]  # fmt: skip
        except (SweepError, ValueError) as e:
            notes.append(f"{name}: cannot list the expected runs: {e}")
            continue
        out[specs[0][0] if specs else name] = [run_id for _, run_id in specs]
    return out, notes


STATE_COLUMNS = ("done", "incomplete", "running", "failed", "cancelled", "copy", "missing")


LISTED = 12
"""Run ids listed per (sweep, state) in status.md; the rest are counted (slurm.status lists them all)."""


def _some(ids, sweep: str) -> str:
    ids = list(ids)
    if len(ids) <= LISTED:
        return ", ".join(ids)
    more = len(ids) - LISTED
    return f"{', '.join(ids[:LISTED])} and {more} more (`python -m slurm.status {sweep} --preset P` lists every run)"


def status_markdown(report: dict, issues, notes, not_tabled: dict | None = None) -> str:
    lines = [
        "### Run status per sweep\n",
        "done = counted runs (a config shared by several sweeps is one run, counted in each); incomplete = finished "
        "but short of its configured steps, without its final eval, or with non-numbers in its metrics (excluded); "
        "copy = a second folder of a config counted elsewhere (excluded).\n",
        "| sweep | " + " | ".join(STATE_COLUMNS) + " | other |",
        "|---|" + "---|" * (len(STATE_COLUMNS) + 1),
    ]
    for sweep, states in report.items():
        other = sum(len(v) for k, v in states.items() if k not in STATE_COLUMNS)
        lines.append(f"| {sweep} | " + " | ".join(str(len(states.get(k, []))) for k in STATE_COLUMNS) + f" | {other} |")
    listed = [(sweep, st, ids) for sweep, states in report.items() for st, ids in states.items() if st != "done"]
    listed = [x for x in listed if not (x[1] == "missing" and set(report[x[0]]) == {"missing"})]  # never run
    if listed:
        lines += ["", "Runs not counted:", ""]
        lines += [f"- {sweep} {st}: {_some(ids, sweep)}" for sweep, st, ids in listed]
    if not_tabled:
        lines += ["", "Not tabled (analysis.demo draws its own figure from them):", ""]
        lines += [f"- {sweep}: {n} run(s)" for sweep, n in not_tabled.items()]
    if issues:
        lines += ["", "Load issues (runs that are not done, incomplete or copies are excluded everywhere):", ""]
        lines += [f"- {i}" for i in issues]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


_NOT_EXPANDED = re.compile(r"^([\w.-]+) \(preset ([\w.-]+)\): not expanded: ")


def note_lines(notes, verbose: bool = False) -> list[str]:
    """The notes as printed: with ``verbose`` each as it is; else a sweep's "not expanded with preset P" notes (every
    sweep file is matched against the presets the runs were made with, and a sweep's configs may not be valid on some
    of them: a fact, not an error) become one line per sweep, the detail behind --verbose and in tables/status.md."""
    if verbose:
        return list(notes)
    out, grouped = [], {}
    for n in notes:
        m = _NOT_EXPANDED.match(n)
        if m is None:
            out.append(n)
        else:
            grouped.setdefault(m.group(1), []).append(m.group(2))
    for sweep, presets in grouped.items():
        out.append(
            f"{sweep}: not matched against the runs of preset {', '.join(presets)}: its configs are not valid on "
            "that preset (--verbose or tables/status.md say why)"
        )
    return out


def print_status(report: dict, notes, verbose: bool = False) -> None:
    for sweep, states in report.items():
        if set(states) == {"missing"}:
            print(f"  {sweep}: not run ({len(states['missing'])} runs in its sweep file)")
            continue
        done = len(states.get("done", []))
        parts = [f"{sweep}: {done} done"]
        for st in sorted(states):
            if st != "done":
                ids = states[st]
                parts.append(f"{len(ids)} {st}: {', '.join(ids[:8])}{' ...' if len(ids) > 8 else ''}")
        print("  " + "; ".join(parts))
    for n in note_lines(notes, verbose):
        print("  note: " + n)


def legacy_note(inc) -> list[str]:
    """``["N legacy run(s) ... from commit X"]`` for counted runs made by older code (their recorded hash differs from
    today's), or []: each is counted only because no run of its config by today's code exists."""
    if not len(inc) or "legacy" not in inc.columns or not inc["legacy"].any():
        return []
    old = inc[inc["legacy"]]
    commits = sorted({str(c)[:12] for c in old["git_commit"].dropna()}) if "git_commit" in old.columns else []
    return [
        f"{len(old)} legacy run(s) from commit(s) {', '.join(commits) or 'unknown'}: made by older code (the hash in "
        "their config.yaml differs from today's); each is counted because no run of its config by today's code exists"
    ]


def warn_excluded(rs: RunSet) -> dict[str, int]:
    """Print to stderr, with counts, every run folder left out of the tables (incomplete, copies, not done)."""
    runs = rs.runs
    if not len(runs):
        return {}
    out = runs.loc[~runs["included"]]
    kinds = out["state"].map(lambda st: "copy" if str(st).startswith("copy") else str(st))
    counts = {k: int(v) for k, v in kinds.value_counts().sort_index().items()}
    if counts:
        total = sum(counts.values())
        detail = ", ".join(f"{v} {k}" for k, v in counts.items())
        print(f"make_all: {total} run folder(s) excluded from every table, figure and claim ({detail}); "
              "see tables/status.md", file=sys.stderr)  # fmt: skip
        for rec in out.itertuples(index=False):
            if rec.state == "incomplete":
                print(f"  incomplete: {rec.folder}: {rec.problem}", file=sys.stderr)
    return counts


def readme_block(claims_md: str, fig_dir: Path, readme: Path, n_runs: int, sweeps: list[str], n_seeds_note="") -> str:
    rel = Path(os.path.relpath(fig_dir, readme.parent))
    figs = [
        f"![{name}]({(rel / (name + '.png')).as_posix()})"
        for name in README_FIGURES
        if (fig_dir / f"{name}.png").exists()
    ]
    head = (
        f"_Generated by `python -m analysis.make_all` from {n_runs} distinct finished run(s)"
        f"{' of ' + ', '.join(sweeps) if sweeps else ''}{n_seeds_note}; edit analysis/claims.yaml, not this block._\n\n"
    )
    return head + claims_md + ("\n" + "\n".join(figs) + "\n" if figs else "")


def rewrite_readme(readme: Path, block: str, counts: dict[str, str] | None = None) -> bool:
    """Replace the text between the claims markers and, with ``counts``, the value of every count marker outside
    the block; False (README untouched) when the claims markers are absent."""
    text = readme.read_text()
    if START not in text or END not in text:
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    if counts is not None:
        head, tail = fill_counts(head, counts), fill_counts(tail, counts)
    write_text(readme, f"{head}{START}\n{block}{END}{tail}")
    return True


def make_all(
    runs: Path = RUNS_ROOT,
    out: Path = OUT_ROOT,
    readme: Path | None = None,
    formats=("png",),
    sweeps_dir: Path | None = None,
    presets_dir: Path | None = None,
    quiet: bool = False,
    jobs: int | None = None,
    cache: Path | None = None,
    verbose: bool = False,
    regime_path: Path | None = None,
) -> dict:
    """Build everything; returns {"files": [...], "status": {...}, "claims": [...], "issues": [...], ...}.

    ``jobs``: worker processes that read the run folders' logs and draw the figures (analysis.parallel); None =
    every core (:func:`analysis.parallel.default_jobs`) when there are at least :data:`PARALLEL_MIN_RUNS` run folders,
    else 1 (starting workers costs more than they save). ``cache``: a folder keeping each run's parsed logs
    (analysis.load.log_cache_dir(), what the command line uses unless --no-cache); None parses every run. The files
    written depend on neither. ``regime_path``: the evidence plan whose sealed stages' sweeps stay out of every output
    until all their planned runs are done (:func:`sealed_sweeps`; default analysis/regime.yaml)."""
    out = check_out(Path(out))
    if readme is not None and Path(readme).is_file():
        check_readme_counts(readme, sweeps_dir)
    if jobs is None:
        jobs = default_jobs() if len(find_run_dirs(Path(runs))) >= PARALLEL_MIN_RUNS else 1
    with worker_pool(check_jobs(jobs, "--jobs")) as pool:
        return _make_all(Path(runs), out, readme, formats, sweeps_dir, presets_dir, quiet, pool, cache, verbose,
                         regime_path)  # fmt: skip


def _make_all(runs, out, readme, formats, sweeps_dir, presets_dir, quiet, pool, cache, verbose=False,
              regime_path=None) -> dict:  # fmt: skip
    say = (lambda *a: None) if quiet else print
    tab_dir, fig_dir = inside(out / "tables", out), inside(out / "figures", out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)  # collected in rs.issues and written to status.md
        rs = load_runs(runs, sweeps_dir=sweeps_dir, presets_dir=presets_dir, pool=pool, cache=cache)
        curves = eval_curves(rs.eval_counts())
        summary = summarize(rs, curves=curves)
        expected, notes = expected_runs(rs, sweeps_dir, presets_dir)
        seals = sealed_sweeps(regime_path)
        report = status_report(rs, expected)
        sealed = still_sealed(seals, expected, report)
        not_tabled = {sw: int((summary["sweep"] == sw).sum()) for sw in NOT_TABLED if (summary["sweep"] == sw).any()}
        summary = summary[~summary["sweep"].isin([*NOT_TABLED, *sealed])].reset_index(drop=True)
        inc = rs.included[rs.included["run"].isin(summary["run"])]
        nsr_runs = set(inc.loc[inc["loss.rule"] == "nsr", "run"]) if "loss.rule" in inc.columns else set()
        bins = rs.ratio_bins(nsr_runs)  # read here, so problems in these files reach status.md too
    notes = [*legacy_note(inc), *notes]
    notes += [
        f"{sweep}: sealed until all its planned runs are done ({done} of {planned}; analysis/regime.yaml, "
        f"{seals[sweep]}): no table, figure or claim reads its runs yet"
        for sweep, (done, planned) in sealed.items()
    ]
    report = {k: v for k, v in report.items() if k not in NOT_TABLED}
    n_distinct = summary["run"].nunique()
    say(f"runs under {runs}: {n_distinct} distinct run(s) counted, from {len(rs.runs)} folder(s)")
    excluded = warn_excluded(rs) if not quiet else {}
    print_status(report, notes + rs.notes, verbose) if not quiet else None
    tab = lambda name: inside(tab_dir / name, out)  # noqa: E731
    fig = lambda name: inside(fig_dir / name, out)  # noqa: E731
    files = [write_text(tab("status.md"), status_markdown(report, rs.issues, notes + rs.notes, not_tabled), out)]

    # the figures are drawn by the pool's workers while this process builds the tables and claims; each task gets
    # only what its figure reads of the RunSet (its runs' step rows, the runs table), so little is sent
    drawn: list = []  # futures of lists of files, in the order the files are listed

    def draw(fn, *args, **kw):
        drawn.append(pool.submit(fn, *args, **kw))

    def part(sweep):
        mine = summary.loc[summary["sweep"] == sweep, "run"]
        steps = rs.steps[rs.steps["run"].isin(mine)] if len(rs.steps) else rs.steps
        crv = curves[curves["run"].isin(mine)] if len(curves) else curves
        return SimpleNamespace(runs=rs.runs, steps=steps), crv

    sweeps = sorted(summary["sweep"].unique())
    for sweep in sweeps:
        r, c = part(sweep)
        draw(figures.dynamics, r, summary, c, sweep, fig(f"{sweep}_dynamics"), formats)
    draw(figures.delta_sweep, SimpleNamespace(runs=rs.runs, steps=None), summary, fig("delta_sweep"), formats=formats)
    r, c = part("judge_executor")
    draw(figures.judge_executor, r, summary, c, fig("judge_executor"), formats=formats)
    draw(figures.theory, fig("theory_expected_weight"), formats=formats, bins=bins)
    draw(figures.clip_depth, bins, fig("clip_depth"), formats=formats)
    draw(figures.pass_at_k_figure, summary, fig("pass_at_k"), formats=formats)
    draw(figures.screening, summary, fig("screening"), formats=formats)

    for sweep in sweeps:
        t = tables.sweep_tables(summary, sweep)
        name = table_name(sweep)
        files.append(write_text(tab(f"{name}.md"), t["md"], out))
        files.append(write_text(tab(f"{name}.tex"), t["tex"], out))
        rows = summary[summary["sweep"] == sweep].drop(columns=["point"])
        # per-benchmark columns (pass@k[bench], greedy[bench]) of benchmarks no run of this sweep evaluates on
        rows = rows.drop(columns=[c for c in rows.columns if c.endswith("]") and rows[c].isna().all()])
        csv = rows.to_csv(index=False, float_format="%.6g")
        files.append(write_text(tab(f"{sweep}_runs.csv"), csv, out))
    main = tables.main_table(summary, rs.runs, tables.load_paper())
    files += [write_text(tab("main.md"), main["md"], out), write_text(tab("main.tex"), main["tex"], out)]

    claim_list, min_pairs = claims_mod.load_claims()
    results = claims_mod.evaluate(summary, claim_list, min_pairs, rs=rs)
    claims_md = claims_mod.render(results)
    files.append(write_text(tab("claims.md"), "### The paper's claims on the CPU grid\n\n" + claims_md, out))
    draw(figures.forest, results, fig("forest"), formats=formats)
    post_list, post_pairs = claims_mod.load_claims(claims_mod.POSTHOC_FILE)
    posthoc = claims_mod.evaluate(summary, post_list, post_pairs, rs=rs)
    posthoc_md = claims_mod.render(posthoc, posthoc=True)
    files.append(write_text(tab("posthoc.md"), "### Post-hoc readings of the CPU grid (not planned)\n\n" + posthoc_md,
                            out))  # fmt: skip
    if (summary["sweep"] == collapse.SWEEP).any():  # the pre-registered judge/executor collapse test
        judged = collapse.judge_collapse(rs, sesoi=claims_mod.collapse_sesoi(claim_list, collapse.SWEEP))
        files.append(write_text(tab("judge_collapse.md"), collapse.render(judged), out))
        say(f"judge/executor collapse test (tables/judge_collapse.md): {judged['verdict']}")
    if (summary["sweep"] == "regime_search").any():  # the pre-registered stage-A readout (analysis/regime.yaml)
        stage_a = regime.regime_readout(runs, rs=rs)  # from the runs loaded above: each folder is read once
        head = "### Stage A: regime search (pre-registered in analysis/regime.yaml; `python -m analysis.power regime`)"
        files.append(write_text(tab("stage_a.md"), f"{head}\n\n{regime.readout_markdown(stage_a)}", out))
        say(f"stage A readout (tables/stage_a.md): {regime.verdict(stage_a)}")
    if (summary["sweep"] == "regime_a2").any():  # stage A2 (analysis/regime.yaml, section stage_a2)
        stage_a2 = regime.regime_readout(runs, stage="a2", rs=rs)
        head = "### Stage A2: regime search, direct gate (pre-registered; `python -m analysis.regime ROOT --stage a2`)"
        files.append(write_text(tab("stage_a2.md"), f"{head}\n\n{regime.readout_markdown(stage_a2)}", out))
        say(f"stage A2 readout (tables/stage_a2.md): {regime.verdict(stage_a2)}")
    if (summary["sweep"] == "regime_a3").any():  # stage A3 (analysis/regime.yaml, section stage_a3): the gate alone
        stage_a3 = regime.a3_readout(rs=rs)
        head = "### Stage A3: the direct gate on the toy (pre-registered; `python -m analysis.regime ROOT --stage a3`)"
        files.append(write_text(tab("stage_a3.md"), f"{head}\n\n{regime.a3_markdown(stage_a3)}", out))
        say(f"stage A3 readout (tables/stage_a3.md): {stage_a3['outcome']} ({stage_a3['counted']} of 8 runs)")
    if (summary["sweep"] == "regime_r0").any():  # stage R0 (section stage_r0): the premise meter on SmolLM2
        stage_r0 = regime.r0_readout(Path(runs) / "regime_r0")
        head = (
            "### Stage R0: the premise meter on SmolLM2 (pre-registered; `python -m analysis.regime ROOT --stage r0`)"
        )
        files.append(write_text(tab("stage_r0.md"), f"{head}\n\n{regime.r0_markdown(stage_r0)}", out))
        say(f"stage R0 readout (tables/stage_r0.md): {stage_r0['outcome']} ({len(stage_r0['runs'])} done runs)")
    for task in drawn:  # every figure is on disk before the README block and the report look for them
        files += task.result()
    if readme is not None:
        block = readme_block(claims_md, fig_dir, readme, n_distinct, sweeps)
        if rewrite_readme(readme, block, run_counts(summary, rs, report, expected)):
            files.append(readme)
        else:
            say(f"note: {readme} has no {START} / {END} markers; README not changed")
    page = report_mod.render_report(
        out, claims_md, posthoc_md, [f for f in files if f.suffix == ".png" and f.parent == fig_dir],
        [f for f in files if f.suffix == ".md" and f.parent == tab_dir],
        report, rs.issues, n_distinct, len(rs.runs), excluded or _excluded_counts(rs), not_tabled,
        legacy_note(inc),
    )  # fmt: skip
    files.append(write_text(inside(out / "report.html", out), page, out))
    for gone in prune_stale(tab_dir, fig_dir, files):
        say(f"removed {gone}: an output of a sweep that has no counted run any more")
    return {"files": files, "status": report, "claims": results, "posthoc": posthoc, "issues": rs.issues,
            "summary": summary}  # fmt: skip


def prune_stale(tab_dir: Path, fig_dir: Path, written) -> list[Path]:
    """Remove the per-sweep outputs of sweeps that were not written this time (their runs were deleted or moved):
    for each ``<sweep>_runs.csv`` not written, ``<sweep>.md|.tex|_runs.csv`` and ``<sweep>_dynamics.png|pdf|svg``.
    A file written this time is never removed (``main.md`` is also the paper table); returns the removed files."""
    keep = {Path(p).resolve() for p in written}
    gone = []
    for csv in sorted(Path(tab_dir).glob("*_runs.csv")):
        if csv.resolve() in keep:
            continue
        name = csv.name[: -len("_runs.csv")]
        stale = [tab_dir / f"{table_name(name)}{ext}" for ext in (".md", ".tex")] + [csv]
        stale += [fig_dir / f"{name}_dynamics.{ext}" for ext in ("png", "pdf", "svg")]
        for p in stale:
            if p.is_file() and p.resolve() not in keep:
                p.unlink()
                gone.append(p)
    return gone


def _excluded_counts(rs: RunSet) -> dict[str, int]:
    runs = rs.runs
    if not len(runs):
        return {}
    kinds = runs.loc[~runs["included"], "state"].map(lambda st: "copy" if str(st).startswith("copy") else str(st))
    return {k: int(v) for k, v in kinds.value_counts().sort_index().items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis.make_all", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=Path, default=RUNS_ROOT, help="results folder <runs>/<sweep>/<run_id>/")
    p.add_argument("--out", type=Path, default=OUT_ROOT, help="writes <out>/tables, <out>/figures, <out>/report.html")
    p.add_argument("--readme", type=Path, help="README to update (default: the repo's, when --out is the default)")
    p.add_argument("--no-readme", action="store_true", help="do not touch any README")
    p.add_argument("--format", nargs="+", default=["png"], choices=["png", "pdf", "svg"], help="figure formats")
    p.add_argument("--sweeps-dir", type=Path, help="sweep files (default sweeps/): shared runs and missing runs")
    p.add_argument("--presets-dir", type=Path, help="preset files (default sweeps/presets/)")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"worker processes for reading logs and drawing figures (default: ${JOBS_ENV} or every core, "
                        f"up to {MAX_DEFAULT_JOBS}, from {PARALLEL_MIN_RUNS} run folders on; 1 = none)")  # fmt: skip
    p.add_argument("--no-cache", action="store_true",
                   help="parse every run's logs again (default: keep them parsed in $NSR_CACHE_DIR/analysis, else "
                        "cache/analysis; an entry is used only for the same file bytes and reading code)")  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="print every note in full (default: one line per sweep)")
    a = p.parse_args(argv)
    if not a.runs.is_dir():
        print(f"error: --runs {a.runs}: no such folder", file=sys.stderr)
        return 2
    try:
        check_out(a.out)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.jobs is not None and a.jobs < 1:
        print(f"error: --jobs {a.jobs}: not valid; allowed: an integer >= 1 (1 = no worker processes)", file=sys.stderr)
        return 2
    jobs = a.jobs
    if jobs is None and os.environ.get(JOBS_ENV, "").strip():  # an explicit $NSR_JOBS holds whatever the run count
        try:
            jobs = default_jobs()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cache = None
    if not a.no_cache:
        cache = log_cache_dir()
        prune_log_cache(cache)
    readme = None if a.no_readme else a.readme or (README if a.out.resolve() == OUT_ROOT.resolve() else None)
    t0 = time.perf_counter()
    try:
        res = make_all(a.runs, a.out, readme, tuple(a.format), a.sweeps_dir, a.presets_dir, jobs=jobs, cache=cache,
                       verbose=a.verbose)  # fmt: skip
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenProcessPool as e:  # a worker was killed (out of memory, a signal); a rerun rewrites every file
        print(f"error: a worker process died ({e}); rerun with --jobs 1 (one process) or fewer jobs", file=sys.stderr)
        return 1
    verdicts = ", ".join(f"{r['claim'].id}: {r['verdict']}" for r in res["claims"])
    print(f"claims: {verdicts}")
    print(f"wrote {len(res['files'])} files under {a.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
