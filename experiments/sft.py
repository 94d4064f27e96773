"""Supervised warm start of a testbed policy (the tiny GPT-2, or the trl backend's tiny Qwen2), cached by the hash of
what it depends on (model + sft sections, task name).

Every RL run (any rule, any seed) of the same model/sft/task starts from the same cached checkpoint,
``<cache>/sft/<key>.pt`` with ``<cache>`` = $NSR_CACHE_DIR or ``cache/`` at the repo root. The file is written
atomically (temp file + os.replace) under a file lock, so two jobs that need it at once build it once.

    python -m experiments.sft sweeps/presets/tiny.yaml      # build (or show) the warm start of a preset
    python -m experiments.sft sweeps/presets/tiny-regime.yaml task.name=countdown4 rollout.max_new_tokens=10 \
        sft.steps=1600 --eval                                     # ... and its held-out accuracy (eval section)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from filelock import FileLock
from tqdm import tqdm

from experiments.config import RunConfig
from experiments.models.tiny import build_model
from experiments.rundir import REPO_ROOT, atomic_path, cache_dir
from experiments.tasks.countdown import get_task
from nsr.seeds import generator

SFT_VERSION = 1
"""Bump when the warm-start code changes its numbers, so stale caches are not reused."""
SFT_BETAS = (0.9, 0.98)  # docs/testbed.md, "Warm start (SFT)"


def sft_sections(cfg: RunConfig) -> dict:
    """What the warm start depends on: the model and sft sections and the task's name."""
    d = {"model": cfg.model, "sft": cfg.sft}
    skip = {"untie_embeddings"}  # a real model's option (always false here): keys stay as before it existed
    plain = {k: {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.name not in skip} for k, v in d.items()}
    return {"version": SFT_VERSION, **plain, "task": {"name": cfg.task.name}}


def sft_key(cfg: RunConfig) -> str:
    """16 hex of sha256 over the canonical JSON of the model, sft and task sections."""
    blob = json.dumps(sft_sections(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sft_path(cfg: RunConfig) -> Path:
    return cache_dir() / "sft" / f"{sft_key(cfg)}.pt"


def train_sft(cfg: RunConfig, progress: bool = False) -> tuple[dict, dict]:
    """Train the warm start from scratch. Returns (model state_dict, info).

    Batches of ``sft.batch_size`` training-split problems with one answer each; cross-entropy on the completion
    tokens only; AdamW with linear warmup to ``sft.lr``, then constant.
    """
    task = get_task(cfg.task.name)
    s = cfg.sft
    model = build_model(cfg.model, generator(s.seed, "sft-init"))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=SFT_BETAS, weight_decay=s.weight_decay)
    g = generator(s.seed, "sft-data")
    t0 = time.perf_counter()
    loss = torch.zeros(())
    model.train()
    for step in tqdm(range(s.steps), desc="sft warm start", disable=not progress, leave=False):
        for group in opt.param_groups:
            group["lr"] = s.lr * min(1.0, (step + 1) / s.warmup) if s.warmup else s.lr
        ids = task.sample_train(s.batch_size, g)
        prompts, answers = task.prompts(ids), task.sft_completions(ids, g)
        seq = torch.cat([prompts, answers[:, :-1]], 1)
        logits = model(input_ids=seq, use_cache=False).logits[:, task.prompt_len - 1 :]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), answers.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    info = {
        "key": sft_key(cfg),
        **sft_sections(cfg),
        "final_loss": loss.item(),
        "wall_s": time.perf_counter() - t0,
        "built_by": f"{socket.gethostname()}:{os.getpid()}",
    }
    return model.state_dict(), info


def weights_sha256(state: dict) -> str:
    """sha256 over a state dict's tensors (names, dtypes, shapes and raw bytes, in name order): the identity of a warm
    start's weights, whatever file, host or build time it came with."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def committed_dir() -> Path | None:
    """Committed warm starts, used before the cache: ``results/warm_starts/<key>.pt`` ($NSR_WARM_STARTS names another
    folder; set empty, none). Runs that read one start from the same weights on any machine."""
    raw = os.environ.get("NSR_WARM_STARTS")
    if raw is None:
        return REPO_ROOT / "results" / "warm_starts"
    return Path(raw) if raw else None


def warm_start(cfg: RunConfig, progress: bool = False) -> tuple[dict, dict]:
    """(state_dict, info) of the warm start of ``cfg``: the committed one if there is one, else the cached one, built
    first if it is missing. ``info["sha256"]`` is :func:`weights_sha256` of the state and ``info["source"]`` says
    which file it came from (committed / cache)."""
    store = committed_dir()
    committed = store / f"{sft_key(cfg)}.pt" if store is not None else None
    path = committed if committed is not None and committed.is_file() else sft_path(cfg)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_suffix(".lock")):  # blocks while another job builds the same warm start
            if not path.exists():  # another job may have built it while we waited
                state, info = train_sft(cfg, progress)
                with atomic_path(path) as tmp:
                    torch.save({"state_dict": state, "info": info}, tmp)
    blob = torch.load(path, weights_only=True)
    info = {**blob["info"], "key": sft_key(cfg), "sha256": weights_sha256(blob["state_dict"])}
    info["source"] = "committed" if path == committed else "cache"
    return blob["state_dict"], info


def record_warm_start(rd, cfg: RunConfig, info: dict) -> None:
    """Write the warm start a run starts from into its config.yaml (``meta.warm_start``: key and weights sha256), so
    the analysis pairs only runs that start from the same weights."""
    rd.update_meta(warm_start={"key": sft_key(cfg), "sha256": info["sha256"]})


def check_resume_weights(started: str | None, info: dict, where) -> None:
    """RuntimeError unless a resumed run finds the warm start it started from (``started``: the sha256 its checkpoint
    recorded; None for a checkpoint that recorded none). A warm start rebuilt on another CPU differs."""
    if started is not None and started != info["sha256"]:
        raise RuntimeError(
            f"{where}: this run started from warm start {started[:16]} and this machine's is {info['sha256'][:16]} "
            f"(a warm start built on another CPU differs); resume it where it started, or commit its warm start as "
            f"results/warm_starts/{info['key']}.pt"
        )


def warm_policy(cfg: RunConfig, progress: bool = False, with_info: bool = False):
    """The policy at the warm start of ``cfg``: the model built as SFT built it, with the warm start's weights loaded
    (and, with ``with_info``, the warm start's info: key, sha256, source)."""
    state, info = warm_start(cfg, progress)
    model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
    model.load_state_dict(state)
    return (model, info) if with_info else model


def main(argv: list[str] | None = None) -> int:
    from experiments.config import ConfigError, load_config

    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    do_eval = "--eval" in argv
    argv = [a for a in argv if a != "--eval"]
    if not argv:
        print(__doc__)
        return 2
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _, info = warm_start(cfg, progress=True)
    out = {"path": str(sft_path(cfg)), **info}
    if do_eval:  # held-out accuracy of the warm start, as an RL run's step-0 eval computes it
        from experiments.evaluation.testbed import evaluate, summary

        out["eval"] = summary(evaluate(warm_policy(cfg).eval(), get_task(cfg.task.name), cfg, 0))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
