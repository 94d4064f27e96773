"""``python -m experiments.run --sweep SWEEP [--run RUN_ID] --dry-run``: one JSON line per run with the full launcher
command and the part OpenRLHF's parser receives; imports neither Ray nor vLLM (they are made unimportable here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "sweeps" / "main.yaml"
NO_RAY = "import sys; sys.modules['ray'] = None; sys.modules['vllm'] = None; sys.modules['deepspeed'] = None; "


def _dry(*args):
    code = NO_RAY + f"from experiments.run import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def lines():
    proc = _dry("--sweep", str(SWEEP), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_one_line_per_run_of_the_sweep(lines):
    from experiments.sweep import expand

    assert [ln["run_id"] for ln in lines] == [s.run_id for s in expand(SWEEP)]
    for ln in lines:
        assert ln["argv"][1:3] == ["-m", "nsr.openrlhf.launch"]
        assert ln["argv"][-len(ln["openrlhf_argv"]) :] == ln["openrlhf_argv"]
        nsr_flags = ln["argv"][3 : len(ln["argv"]) - len(ln["openrlhf_argv"])]
        assert all(not a.startswith("--") or a.startswith("--nsr.") for a in nsr_flags)
        out = ln["openrlhf_argv"][ln["openrlhf_argv"].index("--logger.tensorboard_dir") + 1]
        assert Path(out) == ROOT / "results" / "runs" / "main" / ln["run_id"] / "tensorboard"


def test_rules_reach_the_launcher_only(lines):
    rules = {
        ln["run_id"]: ln["argv"][ln["argv"].index("--nsr.rule") + 1] if "--nsr.rule" in ln["argv"] else "hard"
        for ln in lines
    }
    assert set(rules.values()) == {"hard", "nsr"}
    assert all("--nsr.rule" not in ln["openrlhf_argv"] for ln in lines)


def test_one_run(lines):
    run_id = lines[1]["run_id"]
    proc = _dry("--sweep", str(SWEEP), "--run", run_id, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x) for x in proc.stdout.splitlines()] == [lines[1]]


def test_bad_requests_are_clear_errors():
    proc = _dry("--sweep", str(SWEEP), "--run", "no-such-run", "--dry-run")
    assert proc.returncode == 2 and "no-such-run" in proc.stderr


def test_resource_plan_per_run_and_sweep_total(tmp_path, capsys):
    """python -m experiments.openrlhf.plan: per run the rows needed vs written, GPU-hours (allocation and estimate)
    and checkpoint disk; a sweep total; exit 1 while some run lacks rows."""
    from experiments.openrlhf import plan

    site = tmp_path / "site.yaml"
    site.write_text("default: {time_min: 60}\npresets:\n  qwen2.5-math-7b-dapo: {time_min: 600}\n")
    preset = ROOT / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml"
    data = tmp_path / "train.jsonl"
    argv = [str(preset), f"task.train_data={data}", "--site", str(site)]
    assert plan.main(argv) == 1  # no data file yet
    (run, tot) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert run["rows_needed"] == 400 * 512 * 3 and run["rows_written"] is None and not run["rows_ok"]
    assert run["gpus"] == 8 and run["time_limit_h"] == 10 and run["gpu_hours_limit"] == 80
    assert run["jobs_estimate"] == -(-run["gpu_hours_estimate"] // 80) > 1  # 400 DAPO steps outlast one 10 h job
    # 2 DeepSpeed checkpoints (16 B/param) + 8 evaluated HF checkpoints (2 B/param) of 7.62e9 parameters
    assert run["disk_peak_gb"] == pytest.approx((2 * 16 + 8 * 2) * 7.62) and run["disk_kept_gb"] == 0
    assert tot["total"]["runs"] == 1 and tot["total"]["runs_short_of_rows"] == [run["run_id"]]
    assert run["model_local"] is plan.model_local("Qwen/Qwen2.5-Math-7B")  # the HF cache, looked up offline
    assert plan.model_local(str(tmp_path)) and not plan.model_local("nobody/no-such-model")
    data.write_text("{}\n" * run["rows_needed"])
    assert plan.main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["rows_ok"]
