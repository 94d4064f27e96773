"""The CPU preset's parts, without running the loop (fast): the preset and its checks, the model and data built in
code, the evaluator's CPU engine, and that only the CPU preset switches the CPU shim on (no cluster preset imports it).
The loop itself runs in tests/test_openrlhf_e2e.py."""

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import ConfigError, load_config
from experiments.evaluation import math as evaluate
from experiments.models import qwen2, smollm2
from experiments.openrlhf import toy
from experiments.openrlhf.argv import CPU_SETTINGS, build_command
from nsr.openrlhf.launch import CPU_ENV

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "sweeps" / "presets"
CPU_PRESET = PRESETS / "openrlhf-cpu.yaml"
STUBS = ROOT / "tests" / "fixtures" / "openrlhf" / "stubs"


def openrlhf_presets() -> dict[str, object]:
    cfgs = {p.stem: load_config(p) for p in sorted(PRESETS.glob("*.yaml"))}
    return {name: cfg for name, cfg in cfgs.items() if cfg.backend == "openrlhf"}


CPU_PRESETS = {"openrlhf-cpu", "smollm2-openrlhf-cpu", "smollm2-openrlhf-cpu-fp32"}


def test_only_the_cpu_presets_switch_the_shim_on(tmp_path):
    presets = openrlhf_presets()
    assert {*CPU_PRESETS, "qwen2.5-math-7b-dapo", "qwen3-8b-dapo", "qwen3-30b-a3b-gspo"} <= set(presets)
    for name, cfg in presets.items():
        cmd = build_command(cfg, tmp_path / name, name)
        cpu = name in CPU_PRESETS
        assert cfg.openrlhf.cpu == cpu, name
        assert {k: v for k, v in cmd.env.items() if k != "OMP_NUM_THREADS"} == ({CPU_ENV: "1"} if cpu else {}), name
        assert ("OMP_NUM_THREADS" in cmd.env) == (cpu and "OMP_NUM_THREADS" not in os.environ), name
        model = cmd.openrlhf_argv[cmd.openrlhf_argv.index("--actor.model_name_or_path") + 1]
        if qwen2.is_toy_model(cfg):
            assert model == str(qwen2.model_dir(cfg)), name
        elif cfg.model.name == smollm2.NAME:  # the prepared folder, named without converting anything
            assert model == str(smollm2.folder_for()) and model.endswith(smollm2.GGUF_SHA256[:16] + "-v1"), name
        else:
            assert model == cfg.model.name, name


def test_the_cpu_path_is_switched_by_the_field_not_the_model(tmp_path):
    """openrlhf.cpu alone decides: the toy model without it runs no shim (and needs none of the CPU settings), a
    cluster preset's model with it (and the CPU settings) runs the shim."""
    toy_cfg = load_config(CPU_PRESET, ["openrlhf.cpu=false", "openrlhf.extra_args=[]"])
    assert build_command(toy_cfg, tmp_path / "a", "a").env == {}
    extra = "openrlhf.extra_args=[--vllm.sync_backend, gloo, --vllm.enforce_eager, --ds.attn_implementation, eager]"
    big = ["openrlhf.cpu=true", "openrlhf.colocate_all=false", "openrlhf.packing_samples=false", extra]
    cfg = load_config(PRESETS / "qwen2.5-math-7b-dapo.yaml", big)
    assert build_command(cfg, tmp_path / "b", "b").env[CPU_ENV] == "1"
    with pytest.raises(ConfigError, match=r"openrlhf\.colocate_all=True is not valid with openrlhf\.cpu=true"):
        build_command(load_config(PRESETS / "qwen2.5-math-7b-dapo.yaml", ["openrlhf.cpu=true"]), tmp_path / "c", "c")


def test_the_launcher_imports_the_shim_only_when_switched_on(tmp_path):
    """The launcher's own main() on a cluster preset's command (OpenRLHF's train replaced by a recorder, flash_attn
    by its test stand-in): the shim is never imported, nothing CPU-specific is set. Then the only imports of the shim
    in shipped code are the launcher's, behind the switch, and the CPU actor profiler's (CPU presets only)."""
    cfg = load_config(PRESETS / "qwen2.5-math-7b-dapo.yaml", ["loss.rule=nsr"])
    cmd = build_command(cfg, tmp_path / "run", "run")
    code = f"""
import json, os, runpy, sys
sys.path.insert(0, {str(STUBS)!r})
ran = []
runpy.run_module = lambda name, **kw: ran.append(name)
from nsr.openrlhf import launch
launch.main({cmd.argv[3:]!r})
print(json.dumps({{"ran": ran, "shim": "nsr.openrlhf.cpu_shim" in sys.modules,
                  "env": [k for k in ("DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE") if k in os.environ]}}))
"""
    env = {k: v for k, v in os.environ.items() if k not in (CPU_ENV, "DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"ran": ["openrlhf.cli.train_ppo_ray"], "shim": False, "env": []}

    importers = []
    for path in [*ROOT.glob("nsr/**/*.py"), *ROOT.glob("experiments/**/*.py"), *ROOT.glob("slurm/**/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else ""
            if "cpu_shim" in (module or "") or any("cpu_shim" in n for n in names):
                importers.append(str(path.relative_to(ROOT)))
    # besides the launcher, only the CPU actor's profiler (a command of its own that refuses a non-CPU preset)
    assert sorted(importers) == ["experiments/openrlhf/profile_actor.py", "nsr/openrlhf/launch.py"]
    profiler = (ROOT / "experiments" / "openrlhf" / "profile_actor.py").read_text()
    assert "if not cfg.openrlhf.cpu:\n        raise SystemExit" in profiler
    launch_src = (ROOT / "nsr" / "openrlhf" / "launch.py").read_text()
    assert 'if os.environ.get(CPU_ENV) == "1":\n        from nsr.openrlhf import cpu_shim' in launch_src


def test_the_shim_imports_only_what_nsr_may():
    """nsr/ imports torch, the frameworks it plugs into and nsr itself (docs/design.md)."""
    allowed = {"torch", "openrlhf", "vllm", "ray", "deepspeed", "transformers", "nsr"}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    tree = ast.parse((ROOT / "nsr" / "openrlhf" / "cpu_shim.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots - stdlib <= allowed, roots - stdlib - allowed


def test_cpu_worker_extension_has_openrlhfs_worker_signatures():
    """OpenRLHF calls init_process_group / update_weight on the vLLM worker over collective_rpc with WorkerWrap's
    signatures (trainer/ray/vllm_worker_wrap.py, loaded by path: its package imports vLLM)."""

    from nsr.openrlhf import cpu_shim
    from nsr.openrlhf.reference import load_openrlhf_file

    wrap = load_openrlhf_file("trainer/ray/vllm_worker_wrap.py", "wrap")
    for name in ("init_process_group", "update_weight"):
        ours = inspect.signature(getattr(cpu_shim.CPUWorkerExtension, name))
        theirs = inspect.signature(getattr(wrap.WorkerWrap, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_cpu_preset_settings_are_checked_naming_the_field(tmp_path):
    cfg = load_config(CPU_PRESET)
    build_command(cfg, tmp_path / "ok", "ok")  # the preset itself passes
    for override, field in [
        ("openrlhf.colocate_all=true", "openrlhf.colocate_all"),
        ("openrlhf.packing_samples=true", "openrlhf.packing_samples"),
        ("openrlhf.nodes=2", "openrlhf.nodes"),
        ("openrlhf.extra_args=[--vllm.enforce_eager, --ds.attn_implementation, eager]", "--vllm.sync_backend gloo"),
    ]:
        with pytest.raises(ConfigError, match=f"{field}.*allowed"):
            build_command(load_config(CPU_PRESET, [override]), tmp_path / "x", "x")
    extra = list(cfg.openrlhf.extra_args)
    for flag, value in CPU_SETTINGS.items():
        assert flag in extra and (value is None or extra[extra.index(flag) + 1] == value)


def test_tokenizer_round_trips_bytes_and_problems_split(tmp_path):
    tok = toy.build_tokenizer()
    text = "What is 3 + 4?\n\nPut it in \\boxed{}. héllo ✓"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok) == 257 and tok.eos_token_id == 256 and tok(" A").input_ids == [32, 65]  # one id per byte
    train, held_out = toy.problems()
    assert len(train) == 80 and len(held_out) == 20
    assert not {r["problem_id"] for r in train} & {r["problem_id"] for r in held_out}
    assert all(str(eval(r["problem_id"])) == r["label"] and "\\boxed{}" in r["prompt"] for r in train + held_out)
    assert toy.problems() == (train, held_out)  # seeded


def test_the_toy_model_is_seeded_without_touching_the_global_generator():
    import torch

    cfg = load_config(CPU_PRESET)
    tok = toy.build_tokenizer()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = toy.build_model(cfg, tok), toy.build_model(cfg, tok)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random stream is not moved
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name  # the same weights every time
    torch.manual_seed(7)
    c = toy.build_model(cfg, tok)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_write_data_writes_what_the_run_draws(tmp_path):
    cfg = load_config(
        CPU_PRESET,
        [f"task.train_data={tmp_path}/d/toy.jsonl", f"task.data_dir={tmp_path}/d", "train.steps=30"],
    )
    written = toy.write_data(cfg)
    assert set(written) == {"toy-math", "toy-math-eval"}
    rows = [json.loads(line) for line in open(tmp_path / "d" / "toy.jsonl")]
    assert len(rows) >= 30 * cfg.rollout.prompts_per_step and len(rows) % 80 == 0
    assert len({r["problem_id"] for r in rows[:80]}) == 80  # whole passes
    assert toy.write_data(cfg) == {}  # nothing to do the second time


def test_evaluator_uses_one_eager_engine_without_a_gpu(monkeypatch):
    cfg = load_config(CPU_PRESET)
    monkeypatch.setattr(evaluate, "cpu_only", lambda: True)
    assert evaluate.engine_groups(1) == [None]
    with pytest.raises(ValueError, match="--tp 2: no GPU.*allowed: 1"):
        evaluate.engine_groups(2)
    kw = evaluate.engine_kwargs(cfg, 1, cpu=True)
    assert kw["enforce_eager"] and kw["distributed_executor_backend"] == "uni" and kw["max_model_len"] == 88
    assert not kw["enable_chunked_prefill"]
    assert "enforce_eager" not in evaluate.engine_kwargs(cfg, 1, cpu=False)  # GPUs: unchanged (compiled engines)
    assert evaluate.checkpoints(ROOT / "nonexistent", cfg) == {0: str(qwen2.model_dir(cfg))}


def test_shim_test_switches_are_checked(monkeypatch):
    """The shim's test-only switches: the stale-engine count is validated naming the variable; raw log-probs only when
    asked for; the toy model keeps its untied embeddings (its numbers unchanged since tied models are re-tied)."""
    from nsr.openrlhf import cpu_shim

    monkeypatch.delenv(cpu_shim.STALE, raising=False)
    monkeypatch.delenv(cpu_shim.RAW_LOGPROBS, raising=False)
    assert cpu_shim.stale_syncs() is None
    assert cpu_shim._extension() == {"worker_extension_cls": cpu_shim.WORKER_EXTENSION}
    monkeypatch.setenv(cpu_shim.STALE, "3")
    assert cpu_shim.stale_syncs() == 3
    monkeypatch.setenv(cpu_shim.STALE, "-1")
    with pytest.raises(RuntimeError, match="NSR_OPENRLHF_CPU_STALE_VLLM='-1' is not valid; allowed: an integer >= 0"):
        cpu_shim.stale_syncs()
    monkeypatch.setenv(cpu_shim.RAW_LOGPROBS, "1")
    assert cpu_shim._extension()["logprobs_mode"] == "raw_logprobs"
    assert toy.build_model(load_config(CPU_PRESET), toy.build_tokenizer()).config.tie_word_embeddings is False
