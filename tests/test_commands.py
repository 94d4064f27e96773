"""Every command the records and docs name (``python -m X`` in README.md, docs/, results/README.md, analysis/*.yaml,
sweeps/) still runs: each prints its usage with ``--help`` and exits 0. analysis/regime.yaml and the pre-registered
plans are records and are never edited, so a module that moves keeps its old path as an alias (:data:`ALIASES`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    "README.md",
    "results/README.md",
    "Makefile",
    "docs/*.md",
    "analysis/*.yaml",
    "sweeps/*.yaml",
    "sweeps/*/*.yaml",
]
COMMAND = re.compile(r"python -m ([A-Za-z_][\w.]*\w)")
ALIASES = {
    "experiments.tiny.sft": "experiments.sft",
    "experiments.openrlhf.evaluate": "experiments.evaluation.math",
    "experiments.bench_batch": "experiments.bench.batch",
    "experiments.bench_gpu": "experiments.bench.gpu",
    "experiments.bench_loss": "experiments.bench.loss",
    "experiments.verl": "experiments.verl_overrides",
    "experiments.mechanism": "experiments.mechanism_probe",
    "analysis.mechanism": "analysis.mechanism_stats",
}
"""Old module path -> where the module lives now."""
IMPORT_ALIASES = {"nsr.validate": "nsr.value_checks"}
"""Old paths of library modules (no command): kept because ``nsr`` is a public package."""
NOT_OURS = {"pytest"}

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


def named_commands() -> set[str]:
    found = set()
    for pattern in SOURCES:
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
    """``import`` of an old path gives the moved module (one object: patching one patches the other), or, for an old
    path kept as a package (its ``__main__`` runs the command), a package whose attributes are the module's."""
    import importlib

    for old, new in {**ALIASES, **IMPORT_ALIASES}.items():
        was, now = importlib.import_module(old), importlib.import_module(new)
        assert was is now or (hasattr(was, "__path__") and was.main is now.main), old


# ---------------------------------------------------------------- key=value overrides before or after the options
OPTIONS_THEN_OVERRIDES = {
    "experiments.run": ["sweeps/presets/tiny.yaml", "--out", "/nonexistent", "loss.rule=nsr", "--force", "seed=1"],
    "experiments.trl.bench": ["sweeps/presets/trl-tiny.yaml", "--trainer", "kit", "train.minibatches=4"],
    "experiments.verl_overrides": ["sweeps/presets/tiny.yaml", "--preset", "tiny", "loss.rule=nsr", "seed=1"],
    "experiments.tasks.arithmetic": ["sweeps/presets/smollm2-trl-cpu.yaml", "--seed", "3", "loss.rule=nsr", "seed=1"],
    "experiments.openrlhf.plan": ["sweeps/presets/qwen2.5-math-7b-dapo.yaml", "--site", "x.yaml", "loss.rule=nsr"],
    "experiments.mechanism_probe": ["train.lr=1e-4", "--out", "x", "loss.rule=nsr", "--states", "3", "seed=1"],
    "experiments.mechanism_trl": ["walk", "--out", "x", "seed=1", "--probe-set", "p", "loss.rule=nsr"],
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
