"""The GPU timing script runs end to end (CPU smoke size; no timing is asserted)."""

import json

from experiments.openrlhf.bench_gpu import main


def test_bench_gpu_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "--device",
                "cpu",
                "--B",
                "4",
                "--T",
                "64",
                "--dtype",
                "float32",
                "--repeats",
                "2",
                "--rules",
                "hard",
                "nsr",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert [r["loss"] for r in res["rows"]] == ["openrlhf", "hard", "nsr"]
    assert res["rows"][0]["ratio_to_openrlhf"] == 1.0 and all(r["median_ms"] > 0 for r in res["rows"])
    assert 0 < res["clip_frac"] < 0.5
    assert "x OpenRLHF" in capsys.readouterr().out


def test_bench_gpu_without_hard_in_rules(tmp_path, capsys):
    """It used to read the clip fraction from the hard row only and crashed without one."""
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--B", "4", "--T", "64", "--dtype", "float32", "--repeats", "1", "--rules", "nsr"]
    assert main(argv + ["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["loss"] for r in res["rows"]] == ["openrlhf", "nsr"] and 0 < res["clip_frac"] < 0.5
    assert "clipped" in capsys.readouterr().out
