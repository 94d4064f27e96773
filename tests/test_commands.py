"""Every command the docs and the records name (``python -m X`` in README.md, docs/, results/, analysis/*.yaml, sweeps/)
still runs: each prints its usage with ``--help`` and exits 0. The docs name each module by its path today. A record
(a file under results/ or sweeps/, docs/evidence.md, analysis/regime.yaml: what was run and pre-registered, never
rewritten) keeps the command it was made with, so a module that moves keeps its old path as a thin stub
(:data:`ALIASES`) exactly while a record names that path, and no longer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "results/README.md", "results/warm_starts/README.md", "Makefile", "docs/**/*.md", "docs/**/*.yaml"]
"""Pages that explain the repo: they name today's paths only."""
RECORDS = [
    "results/*/*.json",
    "results/*/*.jsonl",
    "results/mechanism/*/*.jsonl",
    "results/tables/*.md",
    "sweeps/*.yaml",
    "sweeps/*/*.yaml",
    "docs/evidence.md",
    "analysis/*.yaml",
]
"""Files that record what was run or pre-registered (results/runs/ holds no command): an old path stays while one of
these names it."""
SOURCES = DOCS + RECORDS
COMMAND = re.compile(r"python -m ([A-Za-z_][\w.]*\w)")
ALIASES = {
    "experiments.bench_gpu": "experiments.bench.gpu",  # results/bench_gpu/2026-12-04-nvidia-h200.json
    "experiments.mechanism_trl": "experiments.mechanism.trl",  # results/mechanism/r1/probe_set.jsonl
}
"""Old module path -> where the module lives now; each is a stub of a few lines (its docstring names the record)."""
IMPORT_ALIASES = {"nsr.validate": "nsr.value_checks"}
"""Old paths of library modules (no command): kept because ``nsr`` is a public package."""
NOT_OURS = {"pytest", "verl.trainer.main_ppo"}  # the docs name them; their help is their own (hydra prints no usage)

PROBE = r"""
import contextlib, io, json, runpy, sys
out = {}
for m in sys.argv[1:]:
    sys.argv = [m, "--help"]
    buf = io.StringIO()
    code = None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_module(m, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    out[m] = [code, buf.getvalue()[:2000]]
print(json.dumps(out))
"""


def named_commands(patterns=SOURCES) -> set[str]:
    found = set()
    for pattern in patterns:
        for path in ROOT.glob(pattern):
            found |= set(COMMAND.findall(path.read_text()))
    return found - NOT_OURS


def test_every_named_command_and_every_old_path_prints_its_usage():
    named = named_commands()
    assert {"experiments.run", "slurm.submit", "analysis.make_all", "experiments.mechanism"} <= named  # the scan works
    assert {"devtools.synthetic_runs", "devtools.bench_make_all"} <= named  # developer support, named in docs
    modules = sorted(named | set(ALIASES))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {m: r for m, r in result.items() if r[0] not in (0, None) or not re.search(r"usage|python -m", r[1])}
    assert bad == {}, f"commands that do not print their usage with --help: {bad}"


def test_an_old_path_is_the_module_itself():
    """``import`` of an old path gives the moved module (one object: patching one patches the other)."""
    import importlib

    for old, new in {**ALIASES, **IMPORT_ALIASES}.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_an_old_path_stays_exactly_while_a_record_names_it():
    """Each stub of :data:`ALIASES` is named by a record (else it goes), says so, and is a few lines; the docs name
    the module by its path today, never by an old one."""
    in_records = named_commands(RECORDS)
    assert {"experiments.mechanism", "analysis.mechanism", "experiments.run"} <= in_records  # the scan reads records
    assert sorted(set(ALIASES) - in_records) == [], "old paths no record names (delete them)"
    for old in ALIASES:
        stub = ROOT / (old.replace(".", "/") + ".py")
        text = stub.read_text()
        assert text.startswith('"""Old path of') and "record" in text.split('"""')[1], stub
        assert len(text.splitlines()) <= 12, f"{stub}: a stub, not a module"
    records = {p for pattern in RECORDS for p in ROOT.glob(pattern)}
    pages = sorted({p for pattern in DOCS for p in ROOT.glob(pattern)} - records)
    assert ROOT / "README.md" in pages and ROOT / "docs/drafts/stage_r1.md" in pages
    old = re.compile(r"python -m (" + "|".join(map(re.escape, ALIASES)) + r")(?![\w.])")
    bad = {str(p.relative_to(ROOT)): old.findall(p.read_text()) for p in pages}
    assert {k: v for k, v in bad.items() if v} == {}, "docs that name an old path instead of today's"


# ---------------------------------------------------------------- key=value overrides before or after the options
OPTIONS_THEN_OVERRIDES = {
    "experiments.run": ["sweeps/presets/tiny.yaml", "--out", "/nonexistent", "loss.rule=nsr", "--force", "seed=1"],
    "experiments.trl.bench": ["sweeps/presets/trl-tiny.yaml", "--trainer", "kit", "train.minibatches=4"],
    "experiments.trl.precision": ["sweeps/presets/trl-tiny.yaml", "--updates", "2", "train.minibatches=4", "seed=1"],
    "experiments.verl_overrides": ["sweeps/presets/tiny.yaml", "--preset", "tiny", "loss.rule=nsr", "seed=1"],
    "experiments.tasks.arithmetic": ["sweeps/presets/smollm2-trl-cpu.yaml", "loss.rule=nsr", "seed=1"],
    "experiments.evaluation.spread": [
        "sweeps/presets/smollm2-trl-cpu.yaml",
        "--seed",
        "3",
        "loss.rule=nsr",
        "--spread",
        "2",
        "2",
        "seed=1",
    ],
    "experiments.openrlhf.plan": ["sweeps/presets/qwen2.5-math-7b-dapo.yaml", "--site", "x.yaml", "loss.rule=nsr"],
    "experiments.mechanism.toy": ["train.lr=1e-4", "--out", "x", "loss.rule=nsr", "--states", "3", "seed=1"],
    "experiments.mechanism.trl": ["walk", "--out", "x", "seed=1", "--probe-set", "p", "loss.rule=nsr"],
    "experiments.openrlhf.profile_actor": ["sweeps/presets/smollm2-openrlhf-cpu.yaml", "--rollouts", "1", "seed=1"],
}
"""Every command with key=value overrides, called with options between and after them."""


class _Parsed(Exception):
    pass


def test_every_command_takes_overrides_before_or_after_its_options(monkeypatch):
    """Each command's own parser, on argv with options before and after its overrides: the overrides all arrive, in
    order (the command stops right after parsing: nothing runs). Every module of the kit that declares an
    ``overrides`` argument is in the table, so a new command is checked too."""
    import argparse
    import importlib

    declared = set()
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        if 'add_argument("overrides"' in path.read_text():
            declared.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert declared == set(OPTIONS_THEN_OVERRIDES)

    for name in ("parse_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, name)

        def stop(self, args=None, namespace=None, _original=original):
            ns = _original(self, args, namespace)
            if hasattr(ns, "overrides"):
                raise _Parsed(ns)
            return ns

        monkeypatch.setattr(argparse.ArgumentParser, name, stop)
    monkeypatch.chdir(ROOT)
    for module, argv in OPTIONS_THEN_OVERRIDES.items():
        want = [a for a in argv if "=" in a and not a.startswith("-")]
        try:
            importlib.import_module(module).main(list(argv))
        except _Parsed as parsed:
            assert parsed.args[0].overrides == want, module
        else:
            raise AssertionError(f"{module}: did not parse")
