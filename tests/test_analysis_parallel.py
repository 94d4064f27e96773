"""make_all's worker processes and its parsed-log cache (analysis.parallel, analysis.load): neither may change a result.

The fixture folder (tests/fixtures/runs) holds good runs and broken ones (no config, a failed and a running run, a
corrupt, a truncated and a cut eval file), so the issues, their order and the exclusions are compared too.
"""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest

from analysis import load as load_mod
from analysis import make_all
from analysis.load import RunWarning, load_runs, log_cache_dir, prune_log_cache
from analysis.parallel import InlinePool, check_jobs, default_jobs, ready, worker_pool

FIXTURE = Path(__file__).parent / "fixtures" / "runs"
REPO = Path(__file__).resolve().parents[1]


def quiet_load(root, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunWarning)
        return load_runs(root, **kw)


def same_runset(a, b) -> None:
    pd.testing.assert_frame_equal(a.runs, b.runs)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.eval_counts(), b.eval_counts())
    pd.testing.assert_frame_equal(a.members, b.members)
    pd.testing.assert_frame_equal(a.ratio_bins(), b.ratio_bins())
    assert a.issues == b.issues  # the same issues, in the same order
    assert a.notes == b.notes


# ------------------------------------------------------------------------------------------------ jobs
def test_jobs_are_checked_and_the_default_follows_the_environment(monkeypatch):
    assert check_jobs(3) == 3 and check_jobs("2") == 2
    for bad in (0, -1, "two", "1.5", ""):
        with pytest.raises(ValueError, match="jobs.*allowed: an integer >= 1"):
            check_jobs(bad)
    monkeypatch.setenv("NSR_JOBS", "3")
    assert default_jobs() == 3
    monkeypatch.setenv("NSR_JOBS", "zero")
    with pytest.raises(ValueError, match="NSR_JOBS='zero'"):
        default_jobs()
    monkeypatch.delenv("NSR_JOBS")
    assert 1 <= default_jobs() <= 8


def test_the_inline_pool_runs_at_once_and_keeps_exceptions_in_the_future():
    pool = InlinePool()
    assert ready(pool) and pool.submit(sum, [1, 2]).result() == 3
    fut = pool.submit(int, "x")
    with pytest.raises(ValueError):
        fut.result()


def test_make_all_refuses_a_bad_jobs_value(tmp_path, capsys):
    assert make_all.main(["--runs", str(FIXTURE), "--out", str(tmp_path), "--jobs", "0", "--no-cache"]) == 2
    assert "--jobs 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--jobs"):
        make_all.make_all(FIXTURE, tmp_path, jobs=0, quiet=True)


def test_a_dead_worker_is_reported_with_what_to_do(tmp_path, capsys, monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    def dies(*a, **k):
        raise BrokenProcessPool("A process in the process pool was terminated abruptly")

    monkeypatch.setattr(make_all, "make_all", dies)
    assert make_all.main(["--runs", str(FIXTURE), "--out", str(tmp_path), "--no-cache"]) == 1
    assert "rerun with --jobs 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ workers
@pytest.mark.slow  # worker processes / the whole pipeline: make test-fast skips it
def test_loading_in_worker_processes_gives_the_inline_result():
    inline = quiet_load(FIXTURE)
    assert {i.kind for i in inline.issues} >= {"no_config", "failed", "running", "truncated", "incomplete"}
    with worker_pool(2) as pool:
        assert isinstance(pool.submit(sum, [1, 2]).result(), int)
        parallel = quiet_load(FIXTURE, pool=pool)
    same_runset(inline, parallel)


# ------------------------------------------------------------------------------------------------ cache
def test_cache_hits_skip_the_parsing_and_a_changed_file_is_parsed_again(tmp_path, monkeypatch):
    root, cache = tmp_path / "runs", tmp_path / "cache"
    shutil.copytree(FIXTURE, root)
    first = quiet_load(root, cache=cache)
    entries = sorted(cache.rglob("*.pkl.z"))
    assert len(entries) == int(first.runs["included"].sum() + (first.runs["state"] == "incomplete").sum())

    def no_parsing(*a, **k):
        raise AssertionError("parsed a run whose files did not change")

    monkeypatch.setattr(load_mod, "_read_run", no_parsing)
    same_runset(first, quiet_load(root, cache=cache))  # every included run from the cache

    run = next((root / "rescue_vs_decay").glob("nsr-s1-*"))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:2]))  # now short of its steps
    with pytest.raises(AssertionError, match="parsed a run"):
        quiet_load(root, cache=cache)
    monkeypatch.undo()
    again = quiet_load(root, cache=cache)
    assert again.runs.set_index("run_id").loc[run.name, "state"] == "incomplete"
    same_runset(again, quiet_load(root))  # what the cache gives = what parsing gives


def test_a_damaged_cache_entry_is_a_miss_and_other_code_versions_are_pruned(tmp_path):
    cache = tmp_path / "cache"
    first = quiet_load(FIXTURE, cache=cache)
    for p in cache.rglob("*.pkl.z"):
        p.write_bytes(p.read_bytes()[:100])  # cut short: unreadable
    same_runset(first, quiet_load(FIXTURE, cache=cache))
    old = cache / "0123456789abcdef"
    old.mkdir()
    (old / "x.pkl.z").write_bytes(b"old")
    assert prune_log_cache(cache) == 1 and not old.exists() and any(cache.rglob("*.pkl.z"))


def test_the_cache_lives_in_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))
    assert log_cache_dir() == tmp_path / "analysis"


# ------------------------------------------------------------------------------------------------ make_all
@pytest.mark.slow  # worker processes / the whole pipeline: make test-fast skips it
def test_make_all_with_workers_and_cache_writes_the_inline_bytes(tmp_path):
    kw = dict(quiet=True, sweeps_dir=tmp_path / "no-sweeps")
    plain = make_all.make_all(FIXTURE, tmp_path / "a", jobs=1, **kw)
    fast = make_all.make_all(FIXTURE, tmp_path / "b", jobs=2, cache=tmp_path / "cache", **kw)
    warm = make_all.make_all(FIXTURE, tmp_path / "c", jobs=2, cache=tmp_path / "cache", **kw)
    names = sorted(p.relative_to(tmp_path / "a") for p in plain["files"])
    assert any(str(n).endswith(".png") for n in names) and any(str(n).endswith(".md") for n in names)
    for other in (fast, warm):
        base = Path(other["files"][0]).parents[1]
        assert sorted(p.relative_to(base) for p in other["files"]) == names
        for n in names:
            assert (base / n).read_bytes() == (tmp_path / "a" / n).read_bytes(), n


@pytest.mark.slow  # worker processes / the whole pipeline: make test-fast skips it
def test_outputs_of_a_sweep_without_runs_are_removed(tmp_path):
    out = tmp_path / "out"
    (out / "tables").mkdir(parents=True)
    (out / "figures").mkdir()
    ghost = [out / "tables" / f"ghost{e}" for e in (".md", ".tex", "_runs.csv")] + [
        out / "figures" / "ghost_dynamics.png"
    ]
    for p in ghost:
        p.write_text("stale")
    (out / "figures" / "demo_dynamics.png").write_text("drawn by analysis.demo")
    res = make_all.make_all(FIXTURE, out, quiet=True, sweeps_dir=tmp_path / "no-sweeps")
    assert not any(p.exists() for p in ghost)
    assert (out / "figures" / "demo_dynamics.png").exists()  # not a tabled sweep's output: kept
    assert all(Path(p).exists() for p in res["files"])


# ------------------------------------------------------------------------------------------------ the command line
PRESTART = """
import os, sys
from analysis.parallel import prestart

prestart(sys.argv[1:])

def parent(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
    except OSError:  # gone meanwhile
        return None


print(sum(parent(p) == str(os.getpid()) for p in os.listdir("/proc") if p.isdigit()))  # fork server, its tracker
"""


@pytest.mark.slow  # starts interpreters: make test-fast skips it
@pytest.mark.parametrize(
    "argv, env, started",
    [
        ([], {}, True),
        (["--jobs", "2"], {}, True),
        (["--jobs", "1"], {}, False),
        ([], {"NSR_JOBS": "1"}, False),
        (["-h"], {}, False),
    ],
)
def test_the_command_line_starts_the_fork_server_only_when_it_will_use_workers(argv, env, started):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc (Linux)")
    environ = {k: v for k, v in os.environ.items() if k != "NSR_JOBS"} | env
    out = subprocess.run([sys.executable, "-c", PRESTART, *argv], capture_output=True, text=True, env=environ,
                         cwd=REPO, check=True)  # fmt: skip
    assert (int(out.stdout.strip()) > 0) == started


@pytest.mark.slow  # worker processes / the whole pipeline: make test-fast skips it
def test_python_dash_m_make_all_with_workers_prints_no_warnings(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "analysis.make_all", "--runs", str(FIXTURE), "--out", str(tmp_path), "--no-readme",
         "--jobs", "2", "--no-cache", "--sweeps-dir", str(tmp_path / "no-sweeps")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr and "wrote " in out.stdout  # runpy warned in each worker, once
