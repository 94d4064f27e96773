"""results/report.html (analysis.make_all) opened in a real headless browser: every image loads, every table is
there. Debian's `chromium` (apt-get install chromium), run as `chromium --headless --no-sandbox`; skipped with the
reason only when no chromium is installed and CI is not set (under CI a missing browser is a failure)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from analysis import make_all
from analysis.report import markdown_html

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

FIXTURE = Path(__file__).parent / "fixtures" / "runs"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str | None:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium on PATH and CI is set: install Debian's chromium (apt-get install -y chromium)")
        pytest.skip("no chromium on PATH (apt-get install -y chromium); CI is not set")
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    runs = out / "runs"
    shutil.copytree(FIXTURE / "rescue_vs_decay", runs / "rescue_vs_decay")
    shutil.copytree(FIXTURE / "broken", runs / "broken")
    res = make_all.make_all(runs, out / "results", quiet=True)
    return out / "results" / "report.html", res


def test_report_lists_every_figure_and_table(report):
    page, res = report
    text = page.read_text()
    pngs = [f for f in res["files"] if f.suffix == ".png"]
    assert pngs and all(f'src="figures/{p.name}"' in text for p in pngs)
    assert 'id="claims"' in text and "<table>" in text and "rescue_vs_decay: mean over seeds" in text
    assert "distinct run(s) counted" in text and "incomplete" in text  # run counts and issues
    assert "broken/failed" in text or "failed-s10" in text


def test_report_opens_in_a_headless_browser_with_every_image_loaded(report, tmp_path):
    page, res = report
    exe = browser()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files", "--dump-dom"]
    cmd = [exe, *flags, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", page.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    n_img = len(re.findall(r"<img ", page.read_text()))
    assert n_img == len([f for f in res["files"] if f.suffix == ".png"]) and n_img > 0
    assert f'data-images="loaded {n_img}/{n_img}"' in dom, dom[:500]
    assert dom.count("<table>") == page.read_text().count("<table>") > 3


def test_markdown_tables_become_html_tables():
    html = markdown_html("### t\n\n| a | b |\n|---|---|\n| **x** | 1 \\| 2<br>3 |\n\n- item `c`\n")
    assert "<h4>t</h4>" in html and "<th>a</th>" in html and "<strong>x</strong>" in html
    assert "<td>1 | 2<br>3</td>" in html and "<li>item <code>c</code></li>" in html
    assert "<script" not in markdown_html("<script>alert(1)</script>")
