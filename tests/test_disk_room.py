"""devtools/disk_room.py: `make test` says up front when the disk cannot hold the venv and the suite's temporary files
(a CI run once filled its disk and failed 20 minutes in with `No space left on device`)."""

import os
import shutil
import subprocess
from pathlib import Path

from devtools import disk_room

ROOT = Path(__file__).resolve().parents[1]
GB = disk_room.GB


def test_needs_count_the_venv_only_until_built_and_add_up_on_one_folder(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert disk_room.needs(False, a, b) == {a: disk_room.VENV_GB, b: disk_room.SUITE_GB}
    assert disk_room.needs(True, a, b) == {a: 0.0, b: disk_room.SUITE_GB}
    assert disk_room.needs(False, a, a) == {a: disk_room.VENV_GB + disk_room.SUITE_GB}


def test_shortfall_reads_the_real_free_space_and_adds_folders_of_one_disk(tmp_path):
    free = shutil.disk_usage(tmp_path).free / GB
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert disk_room.shortfall({str(a): 0.5 * free}) == []
    # each fits alone, together (one disk) they do not
    short = disk_room.shortfall({str(a): 0.6 * free, str(b): 0.6 * free})
    assert len(short) == 1 and str(a) in short[0] and str(b) in short[0] and "needs" in short[0]
    assert disk_room.shortfall({str(a): free * 1000})[0].endswith(f"needs {free * 1000:.1f} GB")


def test_main_exits_2_naming_the_folder_when_the_suite_does_not_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(disk_room.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert disk_room.main(["--venv-built", "--checkout", str(ROOT)]) == 0
    monkeypatch.setattr(disk_room, "SUITE_GB", shutil.disk_usage(tmp_path).free / GB * 2)
    assert disk_room.main(["--venv-built", "--checkout", str(ROOT)]) == 2
    err = capsys.readouterr().err
    assert "make test: not enough disk" in err and str(tmp_path) in err and "TMPDIR" in err


def test_make_test_checks_the_disk_before_anything_else():
    """`make -n test` lists the recipes make would run, in order: the disk check comes first."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under make test
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "test"], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0].startswith("python3 devtools/disk_room.py")
