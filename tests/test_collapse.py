"""The pre-registered judge/executor collapse test (analysis.collapse) on synthetic run folders whose late training
reward is set by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis import collapse as C
from analysis.load import load_runs
from devtools.synthetic_runs import ArmSpec, write_folder
from experiments.sweep import expand

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

# late reward (steps 301-400) per (rule, sigma, seed); steps 1-300 hold 0.9, which the test must ignore
CLEAN = 0.40
NOISY = {0.3: [0.39, 0.38, 0.41, 0.40, 0.39], 0.4: [0.30, 0.36, 0.30, 0.40, 0.39], 0.5: [0.10, 0.20, 0.30, 0.34, 0.5]}


def _set_reward(folder, early: float, late: float, steps: int) -> None:
    path = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r["reward_mean"] = late if r["step"] > 0.75 * steps else early
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_grid(root, noisy: dict, skip=()):
    for spec in expand("judge_executor_sigma"):
        rule, seed = spec.config.loss.rule, spec.config.seed
        if rule == "hard":
            continue
        sigma = spec.config.loss.ratio_noise
        if (rule, sigma, seed) in skip:
            continue
        folder = root / spec.sweep / spec.run_id
        write_folder(folder, spec.config, dict(spec.meta), ArmSpec())
        late = noisy[sigma][seed] if rule == "noisy_decision" else CLEAN
        _set_reward(folder, 0.9, late, spec.config.train.steps)
    return root


@pytest.fixture(scope="module")
def sigma_grid(tmp_path_factory):
    # one pair missing: sigma 0.4 stays undecided unless 3 seeds already collapsed
    return _write_grid(tmp_path_factory.mktemp("runs"), NOISY, skip={("noisy_decision", 0.4, 4)})


# no sigma collapses: every noisy run within 0.03 of clean, one seed of 0.5 below the margin (as on the real grid)
QUIET = {0.3: [0.39, 0.41, 0.40, 0.38, 0.40], 0.4: [0.37, 0.40, 0.39, 0.41, 0.38], 0.5: [0.34, 0.39, 0.40, 0.41, 0.38]}


@pytest.fixture(scope="module")
def quiet_grid(tmp_path_factory):
    return _write_grid(tmp_path_factory.mktemp("quiet"), QUIET)


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
    sesoi = C.claims_sesoi()
    assert sesoi == 0.1 and path.read_text() == C.render(C.judge_collapse(load_runs(sigma_grid), sesoi=sesoi))


@pytest.mark.parametrize("drop, sd", [(0.10, 0.03), (0.06, 0.04), (0.03, 0.02), (0.08, 0.0)])
def test_collapse_power_matches_a_simulation_of_the_rule(drop, sd):
    """collapse_power is the probability that the plan's count rule (>= 3 of 5 seeds below -0.05) calls a sigma
    collapsed when each seed's noisy - clean is normal with mean -drop and SD sd: checked by simulating the rule."""
    rng = np.random.default_rng(7)
    diffs = -drop + sd * rng.standard_normal((200_000, 5))
    simulated = np.mean((diffs < -0.05).sum(axis=1) >= 3)
    assert C.collapse_power(drop, sd, 5, 0.05, 3) == pytest.approx(simulated, abs=0.004)
    if sd > 0:  # the drop seen with 80% power is where the power reaches 80%
        assert C.collapse_power(C.collapse_mde(sd, 5, 0.05, 3), sd, 5, 0.05, 3) == pytest.approx(0.8, abs=1e-9)
    assert C.collapse_power(0.05, 0.03, 5, 0.05, 3) == pytest.approx(0.5)  # a drop of exactly the margin: a coin


def test_rows_state_the_power_at_the_sesoi(sigma_grid):
    from analysis.stats import sd_upper

    out = C.judge_collapse(load_runs(sigma_grid), sesoi=0.1)
    row = next(r for r in out["rows"] if r["sigma"] == 0.3)
    d = np.array(NOISY[0.3]) - CLEAN
    sd = float(np.std(d, ddof=1))
    assert row["sd"] == pytest.approx(sd) and row["sd_upper"] == pytest.approx(sd_upper(sd, 5)) and row["sd_upper"] > sd
    assert row["power"] == pytest.approx(C.collapse_power(0.1, sd_upper(sd, 5), 5, 0.05, 3)) and row["power"] > 0.99
    assert row["mde"] == pytest.approx(C.collapse_mde(sd_upper(sd, 5), 5, 0.05, 3))
    md = C.render(out)
    assert "| power at a drop of 0.1 | drop seen with 80% power |" in md and "| no collapse | 100% |" in md
    assert np.isnan(C.judge_collapse(load_runs(sigma_grid))["rows"][0]["power"])  # no sesoi: no power


def test_the_judge_executor_claim_reads_not_reproduced_when_no_sigma_collapses(quiet_grid, sigma_grid):
    """The real claim (analysis/claims.yaml) on a grid where no sigma collapses with a powered rule: its verdict reads
    exactly 'not reproduced at this scale'; one where a sigma collapses supports that part."""
    from analysis import claims
    from analysis.summary import summarize

    claim = next(c for c in claims.load_claims()[0] if c.id == "judge_executor")
    rs = load_runs(quiet_grid)
    (res,) = claims.evaluate(summarize(rs), [claim], rs=rs)
    coll = [r for r in res["rows"] if r.get("kind") == "collapse"]
    assert [r["verdict"] for r in coll] == [claims.NOT_REPRODUCED] * 3 and [r["collapsed"] for r in coll] == [0, 0, 1]
    assert all(r["power"] >= 0.8 for r in coll) and all(np.isnan(r["p_holm"]) for r in coll)
    assert res["verdict"] == "not reproduced at this scale"
    assert res["testbed"] == "`tiny`: tiny-gpt2 d64 x 2 layers, countdown3, 400 RL steps"
    md = claims.render([res])
    assert md.splitlines()[2].endswith("| **not reproduced at this scale** |")
    assert "(5): not reproduced at this scale (1 of 5 seeds collapsed)" in md
    rs = load_runs(sigma_grid)
    (res,) = claims.evaluate(summarize(rs), [claim], rs=rs)
    coll = {r["a"]: r["verdict"] for r in res["rows"] if r.get("kind") == "collapse"}
    assert coll["noisy_decision ratio_noise=0.5"] == claims.SUPPORTS
    assert coll["noisy_decision ratio_noise=0.4"] == claims.INCONCLUSIVE  # 4 of 5 pairs, 2 collapsed: undecided
