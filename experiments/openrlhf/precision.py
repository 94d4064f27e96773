"""What the other precision does to the ratios an OpenRLHF run's clip reads, replayed on the run's recorded step-1
batch (``logging.record_batches: [1]``; nsr/openrlhf/record.py).

    python -m experiments.openrlhf.precision RUN_DIR [--json OUT]

Step 1's batch was sampled from the run's start weights, with a fresh AdamW state: everything the step's updates
depend on is known, so they can be replayed here without the run's checkpoints. The replay

1. loads the start weights (the run's ``model.name``, as the backend prepared them) in the run's precision (a
   bfloat16 run: bfloat16 weights with float32 master weights, as DeepSpeed's bf16 mode keeps them; a float32 run:
   float32) and takes the step's optimizer steps on the recorded batch as the run took them: the recorded minibatch
   order (torch's RNG state before the step, OpenRLHF's shuffled DataLoader over the buffer's samples), the run's
   micro-batches and gradient accumulation with OpenRLHF's token-mean normaliser over each optimizer step, the run's
   loss (nsr.openrlhf.loss.NSRPolicyLoss with its settings, seed and streams), gradient clipping and AdamW (torch's,
   float32, on the master weights);
2. before each update, computes the micro-batch's log-probs twice: in the run's precision (the ones the update
   trains on; the old log-probs are the run's own, recorded) and in the other precision (float32 from the float32
   master weights for a bfloat16 run, bfloat16 from the weights rounded to it for a float32 run; the old log-probs
   from the start weights in that precision), so log r = log pi - log pi_old in one precision throughout;
3. reports, per side (A > 0, A < 0), the tokens hard clipping drops in each precision, in both, and in one only
   (their clipped status flips with the precision), and the premise meter's counts per depth bin in each precision
   (nsr.PremiseMeter with the run's LossConfig: the rows ratio_bins.jsonl holds). Beside them, the run's own
   step-1 row of ratio_bins.jsonl: the replay in the run's precision reproduces it up to the kernels' rounding
   (DeepSpeed's and vLLM's against plain torch here).

Same folder and threads: the same numbers. Refused, naming the field, before any model work: a run of another
backend, at sequence level, over more than one data-parallel rank, with weight decay (OpenRLHF exempts biases and
norms; the replay does not model that), a learning-rate schedule other than constant, a KL or entropy term, or
without a recorded step-1 batch.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from experiments.config_errors import ConfigError

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def check(cfg, run_dir: Path) -> Path:
    """The recorded batch's path; ConfigError naming the field and what is allowed otherwise."""
    o, t = cfg.openrlhf, cfg.train
    refusals = [
        (cfg.backend != "openrlhf", "backend", cfg.backend, "openrlhf (the run recorded its batch there)"),
        (cfg.loss.level != "token", "loss.level", cfg.loss.level, "token (the clip and the meter read token ratios)"),
        (o.nodes * o.gpus_per_node != 1, "openrlhf.gpus_per_node", o.nodes * o.gpus_per_node, "1 rank in all"),
        (t.weight_decay != 0, "train.weight_decay", t.weight_decay, "0.0"),
        (
            o.lr_scheduler not in ("constant", "constant_with_warmup") or o.lr_warmup_ratio != 0,
            "openrlhf.lr_scheduler",
            f"{o.lr_scheduler} (warmup {o.lr_warmup_ratio})",
            "constant, or constant_with_warmup with openrlhf.lr_warmup_ratio=0",
        ),
        (t.kl_coef != 0 or t.entropy_coef != 0, "train.kl_coef", f"{t.kl_coef} / {t.entropy_coef}", "0.0 and 0.0"),
    ]
    for bad, field, value, allowed in refusals:
        if bad:
            raise ConfigError(f"{field}={value!r} is not valid for the precision replay; allowed: {allowed}")
    path = run_dir / "batches" / "step1-rank0.pt"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: the run recorded no step-1 batch; allowed: a run with logging.record_batches "
            "holding 1"
        )
    return path


def action_log_probs(model, sequences, attention_mask, width: int, temperature: float) -> torch.Tensor:
    """(B, width) log-probs of each sequence's last ``width`` tokens, as OpenRLHF's actor computes them: position ids
    from the attention mask, the logits cast to float32 and divided by the rollout temperature, log-softmax."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos.masked_fill_(attention_mask == 0, 1)
    logits = model(sequences, attention_mask=attention_mask, position_ids=pos).logits[:, -width - 1 : -1].float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, -width:, None])[..., 0]


def count_flips(flips: dict, r_run, r_other, adv, mask, cfg) -> None:
    """Add one micro-batch to ``flips`` ({side: counts}): per side the valid tokens the hard clip drops at the ratios
    of the run's precision, at the other's, at both, and at one only."""
    from nsr.premise import SIDES
    from nsr.theory import clip_sides

    sides = zip(clip_sides(r_run, adv, cfg), clip_sides(r_other, adv, cfg))
    for side, (c_run, c_other) in zip(SIDES[::-1], sides):  # clip_sides gives (A < 0 side, A > 0 side)
        c_run, c_other = c_run & mask, c_other & mask
        f = flips[side]
        f["clipped_run"] += int(c_run.sum())
        f["clipped_other"] += int(c_other.sum())
        f["clipped_both"] += int((c_run & c_other).sum())
        f["flipped"] += int((c_run ^ c_other).sum())


def _load(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(dtype)


def replay(run_dir: str | Path) -> dict:
    """Replay step 1 of the run in ``run_dir`` in both precisions (module doc); every number, as a dict."""
    from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch
    from torch.utils.data import DataLoader

    from experiments.config import load_config
    from experiments.models.qwen2 import model_path
    from experiments.openrlhf.argv import nsr_settings
    from experiments.rundir import RunDir, read_rows
    from nsr.openrlhf.loss import NSRPolicyLoss
    from nsr.openrlhf.record import read_batch
    from nsr.premise import SIDES

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    batch = read_batch(check(cfg, run_dir))
    run_p = "bf16" if cfg.openrlhf.bf16 else "fp32"
    other_p = "fp32" if run_p == "bf16" else "bf16"
    o, t = cfg.openrlhf, cfg.train
    micro = int(batch["sample_batch_size"])
    gas = max(o.train_batch_size // micro, 1)
    settings = nsr_settings(cfg, run_dir)
    kwargs = dict(clip_eps_low=cfg.loss.eps_low, clip_eps_high=cfg.loss.eps_high, dual_clip=cfg.loss.dual_clip,
                  token_level_loss=t.agg_mode == "token-mean")  # fmt: skip
    losses = {p: NSRPolicyLoss(**kwargs, settings=settings, seed=cfg.seed, rank=0) for p in (run_p, other_p)}
    for loss in losses.values():
        loss.start_step(1)
    items = [Experience(**row) for row in batch["samples"]]
    path = model_path(cfg)
    temperature = float(cfg.rollout.temperature)

    model = _load(path, PRECISIONS[run_p])  # the trajectory: the run's precision
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    reader = _load(path, PRECISIONS[other_p]).eval()  # the other precision, from the same start weights: the
    with torch.no_grad():  # master weights (a bfloat16 run's are its bfloat16 weights, as DeepSpeed's start)
        for m, r in zip(master, reader.parameters()):
            r.copy_(m)
    opt = torch.optim.AdamW(master, lr=t.lr, betas=tuple(t.adam_betas), eps=1e-8, weight_decay=0.0, fused=True)

    def read_other(mb) -> torch.Tensor:
        with torch.no_grad():
            return action_log_probs(reader, mb.sequences, mb.attention_mask, mb.action_mask.shape[1], temperature)

    # the old log-probs in the other precision, from the start weights (the run's own are recorded)
    old_other = {}
    for i in range(0, len(items), micro):
        mb = make_experience_batch(items[i : i + micro])
        lp = read_other(mb)
        for j, item in enumerate(items[i : i + micro]):  # right-padded: the item's own positions come first
            old_other[i + j] = lp[j, : item.action_mask.shape[0]]
    index = {id(x): i for i, x in enumerate(items)}

    torch.set_rng_state(batch["rng_state"])  # OpenRLHF's shuffled DataLoader draws its order from it
    loader = DataLoader(items, batch_size=micro, shuffle=True, drop_last=True, collate_fn=lambda b: b)
    flips = {p: {s: 0 for s in ("clipped_run", "clipped_other", "clipped_both", "flipped")} for p in SIDES}
    window: list[list] = []
    micro_rows: list[dict] = []  # per trained micro-batch, in the run's precision (the CPU shim's ratio log's fields)
    updates = 0
    model.train()
    for chunk in loader:
        window.append(chunk)
        if len(window) < gas:
            continue
        masks = [make_experience_batch(c).action_mask for c in window]
        info = {
            "dp_size": 1,
            "batch_num_tokens": sum(m.float().sum() for m in masks) / gas,
            "global_batch_size": sum((m.sum(-1) > 0).sum().float() for m in masks) / gas,
        }
        for chunk_ in window:
            mb = make_experience_batch(chunk_)
            mask, adv = mb.action_mask.bool(), mb.advantages
            width = mask.shape[1]
            lp_run = action_log_probs(model, mb.sequences, mb.attention_mask, width, temperature)
            out = losses[run_p](lp_run, mb.action_log_probs, adv, action_mask=mb.action_mask, **info)
            (out[0] / gas).backward()
            r_run = torch.exp(lp_run.detach() - mb.action_log_probs)
            dev = (r_run - 1).abs()[mask]
            micro_rows.append({"micro": len(micro_rows), "max_ratio_dev": float(dev.max()) if dev.numel() else 0.0,
                               "clip_ratio": float(out[1]), "tokens": int(mask.sum())})  # fmt: skip
            lp_other = read_other(mb).requires_grad_(True)
            own = [old_other[index[id(x)]] for x in chunk_]
            old_o = torch.stack([torch.nn.functional.pad(v, (0, width - v.shape[0])) for v in own])
            losses[other_p](lp_other, old_o, adv, action_mask=mb.action_mask, **info)
            count_flips(flips, r_run, torch.exp(lp_other.detach() - old_o), adv, mask, losses[run_p].cfg)
        # the optimizer step: gradients onto the float32 master weights, clipping, AdamW, the weights back
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.detach().float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(master, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p, r in zip(master, model.parameters(), reader.parameters()):
                p.copy_(m)  # rounded to the run's precision
                r.copy_(m)  # and to the other one
        updates += 1
        window = []

    recorded = None
    bins = RunDir(run_dir).log_path("ratio_bins.jsonl")
    if bins.exists():
        recorded = next((r for r in read_rows(bins)[0] if r.get("step") == 1), None)
    rows = {p: loss.premise.row(1) for p, loss in losses.items()}
    return {
        "run": str(run_dir),
        "run_precision": run_p,
        "other_precision": other_p,
        "samples": len(items),
        "updates": updates,
        "threads": torch.get_num_threads(),
        "tokens": rows[run_p].get("tokens"),
        "flips": flips,
        "meter": rows,
        "micro_batches": micro_rows,
        "recorded_row": recorded,
    }


def table(out: dict) -> str:
    """Markdown: per side the clipped tokens in each precision, in both and flipped; then per side and depth bin the
    meter's clipped counts in each precision and the run's recorded row."""
    run_p, other_p = out["run_precision"], out["other_precision"]
    lines = [
        f"Step 1 of {out['run']} replayed: {out['samples']} samples, {out['updates']} optimizer steps, "
        f"{out['tokens']} response tokens; the run trained in {run_p}.",
        "",
        f"| side | clipped ({run_p}) | clipped ({other_p}) | in both | in one only |",
        "|---|---|---|---|---|",
    ]
    for side, f in out["flips"].items():
        lines.append(f"| {side} | {f['clipped_run']} | {f['clipped_other']} | {f['clipped_both']} | {f['flipped']} |")
    lines += ["", f"| side | depth bin | clipped ({run_p}) | clipped ({other_p}) | run's ratio_bins row |",
              "|---|---|---|---|---|"]  # fmt: skip
    rec = out.get("recorded_row") or {}
    for side in out["flips"]:
        a, b = out["meter"][run_p][f"{side}_clipped"], out["meter"][other_p][f"{side}_clipped"]
        r = rec.get(f"{side}_clipped", [None] * len(a))
        for i, (x, y, z) in enumerate(zip(a, b, r)):
            name = "beyond the zone" if i == len(a) - 1 else f"zone {i + 1}"
            lines.append(f"| {side} | {name} | {x} | {y} | {'-' if z is None else z} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.openrlhf.precision", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="an openrlhf run folder with batches/step1-rank0.pt")
    p.add_argument("--json", type=Path, default=None, help="write every number here, with the command")
    a = p.parse_args(argv)
    try:
        out = replay(a.run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(out), end="")
    if a.json:
        command = "python -m experiments.openrlhf.precision " + shlex.join(argv if argv is not None else sys.argv[1:])
        a.json.write_text(json.dumps({"command": command, **out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
