"""What bfloat16 learner passes (``trl.bf16`` on CPU) do to the ratios the clip and the premise meter read, measured on
one rollout of the trl backend's own trainer.

    NSR_THREADS=1 python -m experiments.trl.precision sweeps/presets/smollm2-trl-cpu.yaml train.minibatches=4 \\
        --updates 3 --json results/smollm2/precision-DATE.json
    python -m experiments.trl.precision --table results/smollm2/precision-DATE.json   # its tables again, no model

On CPU ``trl.bf16=true`` runs every learner log-prob pass under bfloat16 autocast over float32 weights (old and new
alike; nsr/trl/trainer.py). This command builds the trainer the trl backend builds (experiments.trl.train.build_trainer,
float32, without evaluation), lets it generate and score its first training rollout (TRL's loop, the kit's
advantages and the buffered micro-batches), and there, before the run's first update:

1. computes every completion token's log-prob at the rollout's weights through the trainer's own pass
   (``_get_per_token_logps_and_entropies``: the compact / shared-prompt pass where the config turns it on), once in
   float32 and once under bfloat16 autocast (what a ``trl.bf16=true`` trainer computes: tested bit for bit);
2. takes ``--updates`` K optimizer steps on the rollout, float32, as the run takes them (the trainer's training_step
   on the buffered micro-batches in the run's order, its loss, AdamW with the run's lr, betas, weight decay and
   gradient clip; experiments.trl.replay.optimizer_steps), and after each step computes the new log-probs again in
   each precision, so log r = log pi_new - log pi_old in one precision throughout;
3. reports per step (0 = before any update, where float32 log r is exactly 0) over every valid completion token: mean
   and max |log r_bf16 - log r_fp32|, mean |log pi_bf16 - log pi_fp32| at the step's weights, p50 / p99 / max of
   |log r| in each precision, the share of tokens the trust region clips in each (A > 0 and r > 1 + eps_high, or
   A < 0 and r < 1 - eps_low: nsr.theory.is_clipped with the trainer's LossConfig) and the share whose clipped
   status differs, and the premise meter's counts (nsr.premise.PremiseMeter with the run's LossConfig: per side the
   clipped, rescued and weight of each depth bin, the rule's gradient from its own loss) in each precision.

The shares are over all valid completion tokens (``tokens``; ``tokens_adv`` of them have A != 0, the only ones that can
be clipped). ``--json OUT`` writes every number with the command, the git commit, the config's run hash, the torch
thread count (NSR_THREADS, default 1) and the sha256 of the weights at the rollout. Same config, seed and threads:
same numbers (tests/test_trl_precision.py). :func:`measure` needs only a trainer whose ``_buffered_inputs`` hold a
rollout (and whose optimizer exists), so a recorded rollout of a real run can be measured the same way.

Refused before any model work: a backend other than trl, trl.bf16=true (the reference is float32), loss.level other
than token (the clip and the meter read token ratios), ``--updates`` < 1, and a visible CUDA device (there
``trl.bf16`` means bfloat16 weights, which this command does not measure).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

from experiments.config_errors import ConfigError

QUANTILES = (0.5, 0.99)


class _Measured(Exception):
    """Raised from the rollout hook once the measurement is taken: the run stops there."""


def check(cfg, updates: int) -> None:
    """ConfigError naming the field and what is allowed, before any model work."""
    if cfg.backend != "trl":
        raise ConfigError(f"backend={cfg.backend!r} is not valid for experiments.trl.precision; allowed: trl")
    if cfg.trl.bf16:
        raise ConfigError(
            "trl.bf16=True is not valid for experiments.trl.precision; allowed: false (the reference run is float32; "
            "the command computes the bfloat16 passes itself)"
        )
    if cfg.loss.level != "token":
        raise ConfigError(
            f"loss.level={cfg.loss.level!r} is not valid for experiments.trl.precision; allowed: token (the clip "
            "and the premise meter read token ratios)"
        )
    if not isinstance(updates, int) or isinstance(updates, bool) or updates < 1:
        raise ConfigError(f"--updates={updates!r} is not valid; allowed: an integer >= 1")
    if torch.cuda.is_available():
        raise ConfigError(
            "a CUDA device is not valid for experiments.trl.precision: on a GPU trl.bf16 loads bfloat16 weights, "
            "which this command does not measure; allowed: CPU (CUDA_VISIBLE_DEVICES='')"
        )
    from experiments.trl.train import check_runnable

    check_runnable(cfg)  # the trainer's own refusals, still before any model work


def completion_logps(tr, batch: dict, bf16: bool) -> torch.Tensor:
    """(B, T) float32 log-probs of one buffered micro-batch's completion tokens (zero on padding) through the trainer's
    own pass, without gradient; under bfloat16 autocast on the model's device with ``bf16`` (the precision
    ``trl.bf16=true`` gives that pass on CPU)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    autocast = torch.autocast(tr.model.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    with torch.no_grad(), autocast:
        logps, _, _ = tr._get_per_token_logps_and_entropies(
            tr.model, input_ids, attention_mask, batch["completion_ids"].size(1)
        )
    return logps.float()


def _valid(batch: dict) -> torch.Tensor:
    mask = batch["completion_mask"]
    return (mask * batch["tool_mask"] if "tool_mask" in batch else mask).bool()


def _advantages(batch: dict) -> torch.Tensor:
    adv = batch["advantages"]
    return adv.unsqueeze(1) if adv.dim() == 1 else adv


def _side(new: list, old: list, adv: list, mask: list, loss, seed: int, step: int):
    """One precision's numbers at one step, from per-micro-batch (B, T) new and old log-probs, advantages and masks:
    (|log r| quantiles, clipped share and the premise meter's row; the valid tokens' log r; their clipped mask)."""
    from nsr import policy_loss
    from nsr.premise import PremiseMeter, counts_row, token_ratio
    from nsr.seeds import generator
    from nsr.theory import is_clipped

    meter = PremiseMeter(loss)
    log_r, clipped = [], []
    for i, (lp, lp_old, a, m) in enumerate(zip(new, old, adv, mask, strict=True)):
        lp = lp.clone().requires_grad_()  # the rule's gradient d loss_t / d log pi_t, as the meter takes it
        gen = generator("precision", seed, step, i)  # the same draws in both precisions
        loss_tok, _ = policy_loss(lp, lp_old, a, m, loss, gen)
        meter.add(loss_tok, lp, a, m, old_log_probs=lp_old)
        clipped.append(is_clipped(token_ratio(lp, lp_old), a.expand_as(lp), loss)[m])
        log_r.append((lp.detach() - lp_old)[m])
    log_r = torch.cat(log_r).double()
    clipped = torch.cat(clipped)
    absr = log_r.abs()
    n = max(len(absr), 1)
    row = counts_row(meter.counts().cpu(), step, loss, meter.tokens.cpu(), meter.tokens_adv.cpu())
    out = {f"p{round(q * 100)}_abs_log_r": torch.quantile(absr, q).item() if len(absr) else 0.0 for q in QUANTILES}
    out["max_abs_log_r"] = absr.max().item() if len(absr) else 0.0
    out["clipped_share"] = clipped.sum().item() / n
    out["premise"] = row
    return out, log_r, clipped


def _step_numbers(step, old32, old16, new32, new16, adv, mask, loss, seed, grad_norm) -> dict:
    fp32, lr32, clip32 = _side(new32, old32, adv, mask, loss, seed, step)
    bf16, lr16, clip16 = _side(new16, old16, adv, mask, loss, seed, step)
    dlogp = torch.cat([(b - f)[m] for b, f, m in zip(new16, new32, mask, strict=True)]).double().abs()
    diff = (lr16 - lr32).abs()
    n = max(len(diff), 1)
    return {
        "step": step,
        "grad_norm": grad_norm,
        "mean_abs_dlog_r": diff.mean().item() if len(diff) else 0.0,
        "max_abs_dlog_r": diff.max().item() if len(diff) else 0.0,
        "mean_abs_dlog_pi": dlogp.mean().item() if len(dlogp) else 0.0,
        "clipped_status_differs_share": (clip32 != clip16).sum().item() / n,
        "fp32": fp32,
        "bf16": bf16,
    }


def measure(tr, updates: int, seed: int) -> dict:
    """The numbers of the module docstring on ``tr``'s buffered rollout (``tr._buffered_inputs``): ``updates``
    optimizer steps from the weights it holds, float32 and bfloat16-autocast log-probs before and after each. Leaves
    the trainer's weights and optimizer moved by the updates."""
    from experiments.trl.replay import optimizer_steps

    batches = tr._buffered_inputs
    mask = [_valid(b) for b in batches]
    adv = [_advantages(b).float() for b in batches]
    old32 = [completion_logps(tr, b, bf16=False) for b in batches]
    old16 = [completion_logps(tr, b, bf16=True) for b in batches]
    loss = tr.nsr_loss  # the run's LossConfig with its trust region resolved (TRL's epsilon / epsilon_high)
    steps = []
    for k in range(updates + 1):  # step 0: the same passes again at the rollout's weights (float32: log r exactly 0)
        norms = optimizer_steps(tr, 1) if k else []  # one pre-clip gradient norm (none without a clip)
        norm = norms[0] if norms else None
        new32 = [completion_logps(tr, b, bf16=False) for b in batches]
        new16 = [completion_logps(tr, b, bf16=True) for b in batches]
        steps.append(_step_numbers(k, old32, old16, new32, new16, adv, mask, loss, seed, norm))
    tokens = int(sum(m.sum().item() for m in mask))
    tokens_adv = int(sum((m & (a.expand_as(m) != 0)).sum().item() for m, a in zip(mask, adv, strict=True)))
    return {
        "sequences": int(sum(len(m) for m in mask)),
        "micro_batches": len(batches),
        "tokens": tokens,
        "tokens_adv": tokens_adv,
        "lr": tr.args.learning_rate,
        "trust_region": {"eps_low": loss.eps_low, "eps_high": loss.eps_high, "delta": loss.delta},
        "rule": loss.rule,
        "depth_bin_ratio_edges": _edges(loss),
        "steps": steps,
    }


def _edges(loss) -> dict[str, list[float]]:
    """Per side, the ratios at the premise meter's depth-bin edges (depth 0, 0.1, ..., 1; the last bin lies beyond)."""
    from nsr.premise import N_BINS
    from nsr.theory import depth_to_ratio

    return {
        side: [round(float(depth_to_ratio(k / N_BINS, sign, loss)), 6) for k in range(N_BINS + 1)]
        for side, sign in (("pos", 1), ("neg", -1))
    }


def run(cfg, updates: int) -> dict:
    """Build the trl backend's trainer for ``cfg`` (float32), generate its first training rollout and :func:`measure`
    it there. Returns the numbers with the threads and the weights' sha256 at the rollout."""
    from experiments.models.smollm2 import weights_sha256
    from experiments.rundir import RunDir
    from experiments.threads import set_threads
    from experiments.trl.train import build_trainer

    check(cfg, updates)
    threads = set_threads()
    out = {}

    def at_rollout(tr):
        out["weights_sha256"] = weights_sha256(tr.model)
        out.update(measure(tr, updates, cfg.seed))
        raise _Measured

    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = build_trainer(cfg, RunDir(Path(tmp) / "run"), evaluate=False)
        trainer.after_rollout = at_rollout
        try:
            trainer.train()
        except _Measured:
            pass
        else:
            raise RuntimeError("the trainer ended without a training rollout")
        del trainer
    return {"threads": threads, "torch": torch.__version__, **out}


# ------------------------------------------------------------------------------------------------ tables
def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def tables(data: dict) -> str:
    """Markdown tables of a result: the ratios per step, and the premise meter's clipped counts per depth bin."""
    lines = [
        f"{data['sequences']} sequences, {data['tokens']} valid completion tokens ({data['tokens_adv']} with A != 0), "
        f"rule {data['rule']}, eps_low {data['trust_region']['eps_low']}, eps_high {data['trust_region']['eps_high']}, "
        f"delta {data['trust_region']['delta']}, lr {data['lr']}; shares over the valid tokens",
        "",
        "| step | mean abs(log r bf16 - log r fp32) | max | mean abs(log pi bf16 - log pi fp32) | p50 abs(log r) "
        "fp32 / bf16 | p99 abs(log r) fp32 / bf16 | max abs(log r) fp32 / bf16 | clipped fp32 / bf16 | clipped status "
        "differs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in data["steps"]:
        f, b = s["fp32"], s["bf16"]
        lines.append(
            f"| {s['step']} | {s['mean_abs_dlog_r']:.4f} | {s['max_abs_dlog_r']:.3f} | {s['mean_abs_dlog_pi']:.4f} | "
            f"{f['p50_abs_log_r']:.4f} / {b['p50_abs_log_r']:.4f} | {f['p99_abs_log_r']:.3f} / "
            f"{b['p99_abs_log_r']:.3f} | {f['max_abs_log_r']:.2f} / {b['max_abs_log_r']:.2f} | "
            f"{_pct(f['clipped_share'])} / {_pct(b['clipped_share'])} | {_pct(s['clipped_status_differs_share'])} |"
        )
    n_bins = len(data["steps"][0]["fp32"]["premise"]["pos_clipped"]) - 1
    head = " | ".join(f"[{k / n_bins:.1f}, {(k + 1) / n_bins:.1f})" for k in range(n_bins))
    lines += [
        "",
        "Premise meter: clipped tokens per depth bin (0 = the clip boundary, 1 = the rescue zone's far edge), rescued:",
        "",
        f"| step | precision | side | {head} | deeper | clipped | rescued |",
        "|---|---|---|" + "---|" * (n_bins + 3),
    ]
    for s in data["steps"][1:]:
        for prec in ("fp32", "bf16"):
            row = s[prec]["premise"]
            for side in ("pos", "neg"):
                bins = row[f"{side}_clipped"]
                lines.append(
                    f"| {s['step']} | {prec} | {side} | " + " | ".join(str(v) for v in bins) + f" | {sum(bins)} | "
                    f"{sum(row[f'{side}_rescued'])} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from experiments.config import load_config
    from experiments.rundir import git_info

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m experiments.trl.precision", description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="a trl config (preset) file; not with --table")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument("--updates", type=int, default=3, help="optimizer steps on the rollout (>= 1; default 3)")
    p.add_argument("--json", type=Path, help="write every number, with the command, commit and hashes, here")
    p.add_argument("--table", type=Path, help="print the tables of a JSON this command wrote, and nothing else")
    args = p.parse_intermixed_args(argv)  # overrides before or after options
    if args.table is not None:
        if args.config is not None:
            p.error("--table takes no config; allowed: --table JSON alone")
        print(tables(json.loads(args.table.read_text())))
        return 0
    if args.config is None:
        p.error("a config is required (or --table JSON)")
    cfg = load_config(args.config, args.overrides)
    check(cfg, args.updates)
    result = run(cfg, args.updates)
    git = git_info()
    data = {
        "command": shlex.join(["python", "-m", "experiments.trl.precision", *argv]),
        "git_commit": git["git_commit"],
        "git_dirty": git["git_dirty"],
        "config_hash": cfg.run_hash(),
        "config": cfg.to_dict(),
        "updates": args.updates,
        **result,
    }
    print(tables(data))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
