"""The CPU preset's model and data (sweeps/presets/openrlhf-cpu.yaml), built in code: no hub, no binaries committed.

``model.name: cpu-tiny-qwen2`` names a transformers ``Qwen2ForCausalLM`` at toy size (``model.d_model`` x
``model.n_layer``, ``model.n_head`` heads) with a byte-level BPE tokenizer that has no merges (one token per byte,
plus ``<|endoftext|>`` as EOS and pad), so any text round-trips. It is built once into
``<cache>/openrlhf-cpu/<name>-<key>/`` (``<cache>`` = $NSR_CACHE_DIR or ``cache/`` at the repo root; ``key`` hashes
the model section and :data:`BUILD_VERSION`): seeded random weights, then a short supervised warm start on the toy
task's training problems (the response ``\\boxed{sum}``), so about half of the first rollouts are correct, most
groups are mixed and have nonzero advantages, and RL has room to improve. A random policy would score 0 everywhere
and every update would be zero.

The toy task: ``What is a + b? Put the answer in \\boxed{}.`` for single digits a, b (100 problems, a seeded 80 / 20
split), with the sum as label, so the repo's math reward (experiments/rewards/math.py) scores it. The training
file holds whole seeded passes over the 80 training problems (as experiments/openrlhf/data.py writes DAPO), the
benchmark ``toy-math-eval`` the 20 held-out ones.

For the toy model (experiments.models.qwen2.is_toy_model) the backend builds the model and data (:func:`prepare`)
and the argv builder passes the built folder as ``--actor.model_name_or_path`` (experiments.models.qwen2.model_path).
What switches a run onto the CPU path is the preset's ``openrlhf.cpu: true``, not the model (docs/cluster.md, "What is
proven on CPU end to end").
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from experiments.config import RunConfig
from experiments.models.qwen2 import (
    BUILD_VERSION,
    model_dir,
    toy_qwen2,
)
from experiments.openrlhf.data import repeat_shuffled, write_jsonl
from experiments.openrlhf.plan import count_rows, rows_needed, train_data_path
from experiments.rundir import REPO_ROOT

TRAIN_NAME, EVAL_NAME = "toy-math", "toy-math-eval"
EOS_TEXT = "<|endoftext|>"
MAX_POSITIONS = 256
"""Context of the built model: the toy prompt is ~45 byte tokens, its answer ~12."""
SPLIT_SEED, N_TRAIN = 0, 80
WARM_STEPS, WARM_BATCH, WARM_LR = 400, 32, 3e-3
"""Supervised warm start: the answer format and about half the sums (sampled at temperature 1: 47% correct on 20
training and on the 20 held-out problems; ~35 s on 2 busy cores, once)."""


# ---------------------------------------------------------------- the task
def problems() -> tuple[list[dict], list[dict]]:
    """(train, eval) rows ``{prompt, label, datasource, problem_id}``: a + b for digits a, b, seeded split."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(SPLIT_SEED).shuffle(pairs)

    def row(a: int, b: int, name: str) -> dict:
        prompt = f"What is {a} + {b}? Put the answer in \\boxed{{}}."
        return {"prompt": prompt, "label": str(a + b), "datasource": name, "problem_id": f"{a}+{b}"}

    return [row(a, b, TRAIN_NAME) for a, b in pairs[:N_TRAIN]], [row(a, b, EVAL_NAME) for a, b in pairs[N_TRAIN:]]


def answer_text(label: str) -> str:
    """The response the warm start teaches: the answer in the box the reward reads."""
    return f" \\boxed{{{label}}}"


# ---------------------------------------------------------------- the model
def bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character, the byte-level BPE convention (GPT-2): printable Latin-1 bytes map to
    themselves, the other bytes to the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` with no merges: ids 0-255 are the bytes, 256 is EOS / pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TEXT])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token=EOS_TEXT)


def rope_theta(head_dim: int) -> float:
    """2^(head_dim / 2): every RoPE frequency theta^(-2i / head_dim) = 2^-i is then exact in bf16. DeepSpeed ZeRO-3
    holds the actor's RoPE frequencies in bf16 (it casts the model's buffers when it builds it; vLLM keeps them in
    fp32), which with another theta moves the actor's log-probs away from vLLM's by ~2e-3 per token at these
    positions and would blur the weight-sync check (docs/cluster.md, "What is proven on CPU end to end")."""
    return float(2 ** (head_dim // 2))


def build_model(cfg: RunConfig, tokenizer):
    """The Qwen2 of ``cfg.model`` (seeded random weights; experiments/models/qwen2.py), on the tokenizer's vocabulary:
    untied, as it always was (its numbers unchanged; the CPU weight sync re-ties tied models too:
    nsr/openrlhf/cpu_shim.py)."""
    m = cfg.model
    return toy_qwen2(
        m,
        vocab_size=len(tokenizer),
        max_positions=MAX_POSITIONS,
        eos=tokenizer.eos_token_id,
        tie=False,
        rope_theta=rope_theta(m.d_model // m.n_head),
    )


def warm_start(model, tokenizer, train: list[dict]) -> list[float]:
    """Teacher-forced cross-entropy on the responses of seeded batches of training problems; returns the losses."""
    import torch

    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_LR, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    encoded = [(tokenizer(r["prompt"]).input_ids, tokenizer(answer_text(r["label"])).input_ids + [eos]) for r in train]
    losses = []
    model.train()
    for _ in range(WARM_STEPS):
        batch = [encoded[i] for i in torch.randint(len(encoded), (WARM_BATCH,), generator=gen).tolist()]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((len(batch), width), eos)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, r) in enumerate(batch):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def build(cfg: RunConfig) -> Path:
    """Build the CPU model into :func:`model_dir` once (file lock; written to a temporary folder, then renamed)."""
    from filelock import FileLock

    out = model_dir(cfg)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():
            return out
        import torch

        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a toy model: more threads only contend (17x slower with 2 on 2 busy cores)
        try:
            tokenizer = build_tokenizer()
            model = build_model(cfg, tokenizer)
            losses = warm_start(model, tokenizer, problems()[0])
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            info = {"model": cfg.to_dict()["model"], "version": BUILD_VERSION, "warm_start_loss": losses[-1]}
            (tmp / "nsr_build.json").write_text(json.dumps(info, indent=1) + "\n")
            os.replace(tmp, out)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- data files
def benchmark_dir(cfg: RunConfig) -> Path:
    """Where the evaluator looks for ``<benchmark>.jsonl`` (as experiments/evaluation/math.py, from the repo root,
    the backend's working directory)."""
    folder = Path(cfg.task.data_dir) if cfg.task.data_dir else Path(cfg.task.train_data).parent
    return folder if folder.is_absolute() else REPO_ROOT / folder


def write_data(cfg: RunConfig) -> dict[str, Path]:
    """The toy train file at ``task.train_data`` (whole seeded passes, at least the rows the run draws) and the
    ``toy-math-eval`` benchmark, each written only when missing or too short; returns {name: path}."""
    train, held_out = problems()
    path = train_data_path(cfg)
    need = rows_needed(cfg)
    written = {}
    if not path.is_file() or count_rows(path) < need:
        write_jsonl(path, repeat_shuffled(train, -(-need // len(train)), seed=0))
        written[TRAIN_NAME] = path
    if EVAL_NAME in cfg.task.eval_benchmarks:
        bench = benchmark_dir(cfg) / f"{EVAL_NAME}.jsonl"
        if not bench.is_file():
            write_jsonl(bench, held_out)
            written[EVAL_NAME] = bench
    return written


def prepare(cfg: RunConfig) -> Path:
    """Model and data of a CPU run (nothing to do when they are there); returns the model folder."""
    write_data(cfg)
    return build(cfg)
