"""The pre-registered judge/executor collapse test (analysis.collapse) on synthetic run folders whose late training
reward is set by hand."""

from __future__ import annotations

import json

import pytest

from analysis import collapse as C
from analysis.load import load_runs
from analysis.synth import ArmSpec, write_folder
from experiments.sweep import expand

# late reward (steps 301-400) per (rule, sigma, seed); steps 1-300 hold 0.9, which the test must ignore
CLEAN = 0.40
NOISY = {0.3: [0.39, 0.38, 0.41, 0.40, 0.39], 0.4: [0.30, 0.36, 0.30, 0.40, 0.39], 0.5: [0.10, 0.20, 0.30, 0.34, 0.5]}


def _set_reward(folder, early: float, late: float, steps: int) -> None:
    path = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r["reward_mean"] = late if r["step"] > 0.75 * steps else early
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def sigma_grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for spec in expand("judge_executor_sigma"):
        rule, seed = spec.config.loss.rule, spec.config.seed
        if rule == "hard":
            continue
        sigma = spec.config.loss.ratio_noise
        if sigma == 0.4 and seed == 4 and rule == "noisy_decision":
            continue  # one pair missing: sigma 0.4 stays undecided unless 3 seeds already collapsed
        folder = root / spec.sweep / spec.run_id
        write_folder(folder, spec.config, dict(spec.meta), ArmSpec())
        late = NOISY[sigma][seed] if rule == "noisy_decision" else CLEAN
        _set_reward(folder, 0.9, late, spec.config.train.steps)
    return root


def test_collapse_verdicts_follow_the_plan(sigma_grid):
    out = C.judge_collapse(load_runs(sigma_grid))
    rows = {r["sigma"]: r for r in out["rows"]}
    # 0.3: every noisy run within 0.05 of clean, 5 pairs -> no collapse
    assert rows[0.3]["pairs"] == 5 and rows[0.3]["collapsed"] == [] and rows[0.3]["verdict"] == "no collapse"
    assert rows[0.3]["diff"] == pytest.approx(sum(NOISY[0.3]) / 5 - CLEAN)
    # 0.4: seeds 0 and 2 collapse (-0.10), seed 1 does not (-0.04), seed 4 has no pair: 2 of 4 -> incomplete
    assert rows[0.4]["pairs"] == 4 and rows[0.4]["collapsed"] == [0, 2] and rows[0.4]["verdict"] == "incomplete"
    # 0.5: seeds 0, 1, 2 and 3 (-0.06) collapse -> collapses
    assert rows[0.5]["collapsed"] == [0, 1, 2, 3] and rows[0.5]["verdict"] == "collapses"
    assert rows[0.5]["noisy"] == pytest.approx(sum(NOISY[0.5]) / 5) and rows[0.5]["clean"] == pytest.approx(CLEAN)
    # the smallest collapsing sigma is not reported while a smaller one is undecided
    assert out["verdict"] == "undecided: sigma 0.4 has 4 of 5 seed pairs"
    md = C.render(out)
    assert "| 0.5 | 5 | 0.288 | 0.400 |" in md and "| 0, 1, 2, 3 | collapses |" in md


def test_report_line_orders_the_sigmas():
    plan = {"seeds": [0, 1, 2, 3, 4]}
    row = lambda s, v: {"sigma": s, "verdict": v, "pairs": 5}  # noqa: E731
    assert C.report_line([row(0.3, "no collapse"), row(0.4, "collapses"), row(0.5, "collapses")], plan) == (
        "the smallest sigma that collapses is 0.4"
    )
    assert C.report_line([row(0.3, "no collapse"), row(0.5, "no collapse")], plan) == "none collapsed up to sigma 0.5"


def test_cli_on_an_empty_folder(tmp_path, capsys):
    assert C.main(["--runs", str(tmp_path)]) == 0
    assert "undecided: sigma 0.3 has 0 of 5 seed pairs" in capsys.readouterr().out


def test_make_all_writes_the_collapse_table(sigma_grid, tmp_path):
    from analysis import make_all

    res = make_all.make_all(sigma_grid, tmp_path / "out", quiet=True)
    path = tmp_path / "out" / "tables" / "judge_collapse.md"
    assert path in res["files"]
    assert path.read_text() == C.render(C.judge_collapse(load_runs(sigma_grid)))
