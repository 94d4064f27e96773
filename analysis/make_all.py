"""Rebuild every table and figure from the run folders; the only way results/tables and results/figures are made.

    python -m analysis.make_all                          # results/runs -> results/{tables,figures}, README claims
    python -m analysis.make_all --runs DIR --out DIR     # another results folder (README untouched unless --readme)
    python -m analysis.make_all --format png pdf         # also PDF figures for a paper

What it writes (idempotent: the same runs give byte-identical files):
    <out>/tables/<sweep>.md|.tex      arms x metrics, mean [95% bootstrap CI] over seeds; paired differences vs baseline
    <out>/tables/<sweep>_runs.csv     one row per run: every summary metric (analysis.summary)
    <out>/tables/main.md|.tex         the paper's reported numbers (results/paper/main.csv) next to the main sweep
    <out>/tables/claims.md            each claim of the paper: supports / contradicts / inconclusive (analysis.claims)
    <out>/tables/status.md            per sweep: done, running, failed, cancelled and missing runs, and load issues
    <out>/figures/<sweep>_dynamics.png, delta_sweep.png, judge_executor.png, theory_expected_weight.png
and rewrites the README block between ``<!-- claims:start -->`` and ``<!-- claims:end -->``.
It prints, per sweep, the runs that are missing (in the sweep file but without a folder) or not done.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from analysis import claims as claims_mod
from analysis import figures, tables
from analysis.load import RUNS_ROOT, RunSet, RunWarning, load_runs, status_report
from analysis.summary import eval_curves, summarize
from experiments.rundir import REPO_ROOT

OUT_ROOT = REPO_ROOT / "results"
README = REPO_ROOT / "README.md"
START, END = "<!-- claims:start -->", "<!-- claims:end -->"
README_FIGURES = ("theory_expected_weight", "rescue_vs_decay_dynamics", "delta_sweep", "judge_executor")
"""Figures shown in the README block, when they exist."""


def write_text(path: Path, text: str) -> Path:
    """Write only when the content changes (keeps mtimes, and git, quiet on an idempotent rerun)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def expected_runs(rs: RunSet, sweeps_dir: Path | None = None, presets_dir: Path | None = None) -> tuple[dict, list]:
    """{sweep: [run ids its sweep file defines]} for the presets the sweep's runs were made with, and notes.

    A sweep file with no runs at all is expanded with its default preset. Sweep files that fail to expand are
    reported in the notes, never fatal (the tables of the runs that exist are still built)."""
    from sweeps import SWEEPS_DIR, SweepError, expand

    folder = Path(sweeps_dir) if sweeps_dir else SWEEPS_DIR
    out, notes = {}, []
    runs = rs.runs
    for path in sorted(folder.glob("*.yaml")):
        name = path.stem
        mine = runs[runs["sweep"] == name] if len(runs) else runs
        presets = sorted(mine["meta.preset"].dropna().unique()) if "meta.preset" in mine.columns else []
        try:
            specs = [r for p in (presets or [None]) for r in expand(path, preset=p, presets_dir=presets_dir)]
        except SweepError as e:
            notes.append(f"{name}: cannot list the expected runs: {e}")
            continue
        out[specs[0].sweep if specs else name] = [r.run_id for r in specs]
    return out, notes


def status_markdown(report: dict, issues, notes) -> str:
    lines = [
        "### Run status per sweep\n",
        "| sweep | done | running | failed | cancelled | missing | other |",
        "|---|---|---|---|---|---|---|",
    ]
    for sweep, states in report.items():
        known = ("done", "running", "failed", "cancelled", "missing")
        other = sum(len(v) for k, v in states.items() if k not in known)
        lines.append(f"| {sweep} | " + " | ".join(str(len(states.get(k, []))) for k in known) + f" | {other} |")
    listed = [(sweep, st, ids) for sweep, states in report.items() for st, ids in states.items() if st != "done"]
    listed = [x for x in listed if not (x[1] == "missing" and set(report[x[0]]) == {"missing"})]  # never run
    if listed:
        lines += ["", "Runs not done:", ""]
        lines += [f"- {sweep} {st}: {', '.join(ids)}" for sweep, st, ids in listed]
    if issues:
        lines += ["", "Load issues (runs not done are excluded from the tables):", ""]
        lines += [f"- {i}" for i in issues]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def print_status(report: dict, notes) -> None:
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
    for n in notes:
        print("  note: " + n)


def readme_block(claims_md: str, fig_dir: Path, readme: Path, n_runs: int, sweeps: list[str]) -> str:
    rel = Path(os.path.relpath(fig_dir, readme.parent))
    figs = [
        f"![{name}]({(rel / (name + '.png')).as_posix()})"
        for name in README_FIGURES
        if (fig_dir / f"{name}.png").exists()
    ]
    head = (
        f"_Generated by `python -m analysis.make_all` from {n_runs} finished run(s)"
        f"{' of ' + ', '.join(sweeps) if sweeps else ''}; edit analysis/claims.yaml, not this block._\n\n"
    )
    return head + claims_md + ("\n" + "\n".join(figs) + "\n" if figs else "")


def rewrite_readme(readme: Path, block: str) -> bool:
    """Replace the text between the claims markers; False (README untouched) when the markers are absent."""
    text = readme.read_text()
    if START not in text or END not in text:
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
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
) -> dict:
    """Build everything; returns {"files": [...], "status": {...}, "claims": [...]}."""
    say = (lambda *a: None) if quiet else print
    out, tab_dir, fig_dir = Path(out), Path(out) / "tables", Path(out) / "figures"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)  # collected in rs.issues and written to status.md
        rs = load_runs(runs)
        summary = summarize(rs)
        curves = eval_curves(rs.eval_counts())
        inc = rs.included
        nsr_runs = set(inc.loc[inc["loss.rule"] == "nsr", "run"]) if "loss.rule" in inc.columns else set()
        bins = rs.ratio_bins(nsr_runs)  # read here, so problems in these files reach status.md too
    expected, notes = expected_runs(rs, sweeps_dir, presets_dir)
    report = status_report(rs, expected)
    say(f"runs under {runs}: {int(rs.runs['included'].sum()) if len(rs.runs) else 0} done of {len(rs.runs)} folders")
    print_status(report, notes) if not quiet else None
    files = [write_text(tab_dir / "status.md", status_markdown(report, rs.issues, notes))]

    for sweep in sorted(summary["sweep"].unique()):
        t = tables.sweep_tables(summary, sweep)
        files.append(write_text(tab_dir / f"{sweep}.md", t["md"]))
        files.append(write_text(tab_dir / f"{sweep}.tex", t["tex"]))
        csv = summary[summary["sweep"] == sweep].drop(columns=["point"]).to_csv(index=False, float_format="%.6g")
        files.append(write_text(tab_dir / f"{sweep}_runs.csv", csv))
        files += figures.dynamics(rs, summary, curves, sweep, fig_dir / f"{sweep}_dynamics", formats)
    main = tables.main_table(summary, rs.runs, tables.load_paper())
    files += [write_text(tab_dir / "main.md", main["md"]), write_text(tab_dir / "main.tex", main["tex"])]
    files += figures.delta_sweep(rs, summary, fig_dir / "delta_sweep", formats=formats)
    files += figures.judge_executor(rs, summary, curves, fig_dir / "judge_executor", formats=formats)
    files += figures.theory(fig_dir / "theory_expected_weight", formats=formats, bins=bins)

    claim_list, min_pairs = claims_mod.load_claims()
    results = claims_mod.evaluate(summary, claim_list, min_pairs)
    claims_md = claims_mod.render(results)
    files.append(write_text(tab_dir / "claims.md", "### The paper's claims on the CPU grid\n\n" + claims_md))
    if readme is not None:
        block = readme_block(claims_md, fig_dir, readme, len(summary), sorted(summary["sweep"].unique()))
        if rewrite_readme(readme, block):
            files.append(readme)
        else:
            say(f"note: {readme} has no {START} / {END} markers; README not changed")
    return {"files": files, "status": report, "claims": results, "issues": rs.issues}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m analysis.make_all", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=Path, default=RUNS_ROOT, help="results folder <runs>/<sweep>/<run_id>/")
    p.add_argument("--out", type=Path, default=OUT_ROOT, help="writes <out>/tables and <out>/figures")
    p.add_argument("--readme", type=Path, help="README to update (default: the repo's, when --out is the default)")
    p.add_argument("--no-readme", action="store_true", help="do not touch any README")
    p.add_argument("--format", nargs="+", default=["png"], choices=["png", "pdf", "svg"], help="figure formats")
    p.add_argument("--sweeps-dir", type=Path, help="sweep files, for the missing-runs listing (default sweeps/)")
    p.add_argument("--presets-dir", type=Path, help="preset files (default sweeps/presets/)")
    a = p.parse_args(argv)
    if not a.runs.exists():
        print(f"error: --runs {a.runs}: no such folder", file=sys.stderr)
        return 2
    readme = None if a.no_readme else a.readme or (README if a.out.resolve() == OUT_ROOT.resolve() else None)
    t0 = time.perf_counter()
    res = make_all(a.runs, a.out, readme, tuple(a.format), a.sweeps_dir, a.presets_dir)
    verdicts = ", ".join(f"{r['claim'].id}: {r['verdict']}" for r in res["claims"])
    print(f"claims: {verdicts}")
    print(f"wrote {len(res['files'])} files under {a.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
