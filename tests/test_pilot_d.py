"""results/pilot_d/README.md's tables are what devtools.pilot_d prints from the pilot's committed files (its spread
JSON and run folders): every table row of the page is a line of the output."""

from devtools import pilot_d


def test_the_pilot_tables_recompute_from_the_committed_files(capsys):
    assert pilot_d.main([]) == 0
    printed = set(capsys.readouterr().out.splitlines())
    page = (pilot_d.PILOT / "README.md").read_text().splitlines()
    rows = [line for line in page if line.startswith("| ") and not line.startswith("| date")]
    ledger = [line for line in page if line.startswith("| 2026-")]
    assert len(rows) - len(ledger) >= 20
    assert [line for line in rows if line not in printed and line not in ledger] == []
