"""docs/testbed.md's speed tables are what devtools.speed_table prints from the committed JSON lines
(results/smollm2/speed-2026-12-07.jsonl): every table row of its output is a line of the page."""

from devtools import speed_table
from experiments.rundir import REPO_ROOT


def test_the_speed_tables_in_the_docs_recompute_from_the_committed_file(capsys):
    assert speed_table.main([]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    page = set((REPO_ROOT / "docs" / "testbed.md").read_text().splitlines())
    assert len(printed) >= 25
    assert [line for line in printed if line not in page] == []
