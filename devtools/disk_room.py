"""Is there room on disk for ``make test``? Checked before the venv is built, so a full disk is one clear line at the
start instead of a cascade of ``OSError: [Errno 28] No space left on device`` twenty minutes in.

Standard library only: ``make test`` runs it with the system Python before the venv exists.

What the numbers are (measured on a fresh clone with ``CI=true make test``, 2026-12-05, sampling ``du`` every 15 s):
the built venv is 4.4 GB (``du -sh .venv``), with pip's downloads and DeepSpeed's build beside it while it installs;
the suite's temporary files peak at 1.9 GB under the temp folder (``/tmp/pytest-of-<user>``, during
tests/test_smollm2_trl.py's resume test: a TRL checkpoint of SmolLM2-135M with its optimizer state). The needs below
round those up.

    python3 devtools/disk_room.py [--venv-built]     # exit 0, or 2 with what is short and where
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

GB = 1024**3
VENV_GB = 6.0  # the venv being built next to the checkout: 4.4 GB once built, more while pip works
SUITE_GB = 3.0  # the suite's temporary files: 1.9 GB at peak


def needs(venv_built: bool, checkout: str, temp: str) -> dict[str, float]:
    """GB each folder needs free: the checkout's disk the venv (unless built), the temp folder the suite's files."""
    out = {checkout: 0.0 if venv_built else VENV_GB}
    out[temp] = out.get(temp, 0.0) + SUITE_GB
    return out


def shortfall(need_gb: dict[str, float]) -> list[str]:
    """One line per disk that has less free than its folders need (folders on one disk add up); empty when all fit."""
    by_disk: dict[int, list[str]] = {}
    for path in need_gb:
        by_disk.setdefault(os.stat(path).st_dev, []).append(path)
    lines = []
    for paths in by_disk.values():
        need = sum(need_gb[p] for p in paths)
        free = shutil.disk_usage(paths[0]).free / GB
        if free < need:
            lines.append(f"{free:.1f} GB free on the disk of {', '.join(paths)}; needs {need:.1f} GB")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv-built", action="store_true", help="the venv is already built: only the suite's needs")
    ap.add_argument("--checkout", default=os.getcwd(), help="where the venv is built (default: here)")
    args = ap.parse_args(argv)
    short = shortfall(needs(args.venv_built, os.path.abspath(args.checkout), tempfile.gettempdir()))
    for line in short:
        print(
            f"make test: not enough disk: {line} (venv {VENV_GB:.0f} GB unless built, suite temp files "
            f"{SUITE_GB:.0f} GB). Free space there, or set TMPDIR to a folder on a larger disk.",
            file=sys.stderr,
        )
    return 2 if short else 0


if __name__ == "__main__":
    sys.exit(main())
