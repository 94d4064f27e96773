"""GRPO on the tiny testbed with any ``nsr`` objective: the ``tiny`` backend of ``experiments.run``.

    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=nsr loss.delta=0.2 --out /tmp/nsr-demo

One RL step = one rollout (rollout.prompts_per_step training problems x samples_per_prompt completions at
rollout.temperature, binary verifiable reward), ``nsr.compute_advantages`` per group, one no-grad forward for the
old log-probs, then train.epochs x train.minibatches AdamW updates on shuffled minibatches with ``nsr.policy_loss``
+ ``nsr.aggregate`` and gradient clipping. Logged per step to metrics.jsonl (fractions and losses are means over
the step's updates); eval.jsonl at step 0, every eval.every steps and at the last step.

Options from the related literature (docs/method.md, "Related methods"): ``reward.source`` trains on a label-free
reward instead of the verifier's (experiments/tiny/rewards.py; the verifier's reward is still logged as
reward_mean), and ``train.dgg`` gates updates whose lm_head gradient norm surges (nsr.gating: k x the running median
of the norm, the first update of each rollout never gated; the norm is that of the tied embedding matrix's gradient,
before clipping). A gated update skips ``optimizer.step()``, so it changes neither the weights nor Adam's state.
Logged as dgg_gated, the step's gated updates, and lm_head_grad_norm, their mean norm before clipping.

Resumable: a checkpoint (model + optimizer, replaced atomically) every logging.checkpoint_every steps; every random
draw comes from a generator derived from (seed, step, purpose), so a resumed run ends with exactly the rows of an
uninterrupted one (every field but wall_s).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

import nsr
from experiments.config import RunConfig
from experiments.evaluation.testbed import evaluate, summary
from experiments.models.tiny import generate, lm_head_grad_norm, logprobs, response_mask
from experiments.rundir import RunDir, atomic_path
from experiments.sft import check_resume_weights, record_warm_start, sft_key, warm_policy
from experiments.tasks.countdown import Task, get_task
from experiments.threads import set_threads
from experiments.tiny.rewards import train_rewards
from nsr.gating import GradientGate
from nsr.premise import token_ratio
from nsr.seeds import generator

LOSS_METRICS = {"approx_kl": "ppo_kl"}
_LOSS_ORDER = ("approx_kl", *(k for k in nsr.METRIC_KEYS if k != "approx_kl"))  # the order metrics.jsonl has
"""metrics.jsonl names of ``nsr.policy_loss``'s metrics where they differ (ppo_kl, as OpenRLHF logs it)."""


def rl_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    task: Task,
    cfg: RunConfig,
    step: int,
    ref: torch.nn.Module | None = None,
    gate: GradientGate | None = None,
) -> tuple[dict, dict | None]:
    """One rollout and its minibatch updates; returns the metrics row (without wall_s) and, at token level,
    the step's ratio_bins.jsonl row (:class:`nsr.PremiseMeter`). ``gate``: Dynamic Gradient Gating (train.dgg)."""
    ro, tr = cfg.rollout, cfg.train
    P, G = ro.prompts_per_step, ro.samples_per_prompt
    g_roll = generator(cfg.seed, step, "rollout")

    # rollout (docs/method.md, "Setting"): G samples per prompt, binary reward, group-relative advantage
    model.eval()
    ids = task.sample_train(P, g_roll).repeat_interleave(G)  # (N,), N = P * G
    prompts = task.prompts(ids)  # (N, prompt_len)
    comps = generate(model, prompts, ro.max_new_tokens, ro.temperature, g_roll)  # (N, T)
    mask = response_mask(comps)  # (N, T)
    rewards = task.rewards(ids, comps)  # (N,) the verifier's, logged whatever the policy trains on
    groups = torch.arange(P).repeat_interleave(G)
    trained, reward_logs = train_rewards(
        cfg.reward.source, rewards, task, model, prompts, comps, mask, groups, ro.temperature
    )
    adv = nsr.compute_advantages(trained, groups, cfg.advantages, generator=generator(cfg.seed, step, "adv"))
    with torch.no_grad():
        old_logp, ent = logprobs(model, prompts, comps, ro.temperature, with_entropy=True)
        ref_logp = logprobs(ref, prompts, comps, ro.temperature)[0] if ref is not None else None

    # updates: epochs x minibatches optimizer steps on shuffled minibatches of the N samples
    model.train()
    g_shuffle, g_loss = generator(cfg.seed, step, "shuffle"), generator(cfg.seed, step, "loss")
    n = len(ids)
    bins = nsr.PremiseMeter(cfg.loss) if cfg.loss.level == "token" else None
    acc: dict[str, float] = {}
    per_update: dict[str, list[float]] = {k: [] for k in nsr.METRIC_KEYS}  # reduced by nsr.METRIC_REDUCE
    update = 0
    for _ in range(tr.epochs):
        for mb in torch.randperm(n, generator=g_shuffle).chunk(tr.minibatches):
            m = mask[mb]
            logp, mb_ent = logprobs(model, prompts[mb], comps[mb], ro.temperature, with_entropy=tr.entropy_coef > 0)
            loss_tok, met = nsr.policy_loss(logp, old_logp[mb], adv[mb], m, cfg.loss, generator=g_loss)
            if bins is not None:  # token level: the token ratios, for the premise meter and ratio_out_frac
                r = token_ratio(logp, old_logp[mb])
                bins.add(loss_tok, logp, adv[mb], m, ratio=r)
            pg_loss = nsr.aggregate(loss_tok, m, tr.agg_mode)
            loss = pg_loss
            if tr.entropy_coef > 0:
                loss = loss - tr.entropy_coef * nsr.aggregate(mb_ent, m, tr.agg_mode)
            kl = None
            if ref_logp is not None and tr.kl_coef > 0:
                d = ref_logp[mb] - logp  # k3 estimator of KL(pi || pi_ref), OpenRLHF's default for GRPO
                kl = nsr.aggregate(d.exp() - d - 1, m, tr.agg_mode)
                loss = loss + tr.kl_coef * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gated = head_norm = None
            if gate is not None:  # DGG: the tied output matrix's gradient, before clipping
                head_norm = lm_head_grad_norm(model)
                gated = gate.gate(head_norm, first=update == 0)
            update += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
            if not gated:  # a gated update leaves weights and optimizer state as they were
                opt.step()
            ratio_out = None
            if bins is not None:  # token ratios outside the region, either side (clipped or not)
                out = (r[m] < cfg.loss.low) | (r[m] > cfg.loss.high)  # the clamp cannot move r across a bound
                ratio_out = out.float().mean().item()
            record_update(
                acc,
                per_update,
                {k: met[k].item() for k in nsr.METRIC_KEYS},
                policy_loss=pg_loss.item(),
                grad_norm=grad_norm.item(),
                grad_clip=tr.grad_clip,
                ref_kl=None if kl is None else kl.item(),
                head_norm=head_norm,
                gated=gated,
                ratio_out=ratio_out,
            )
    row = step_row(step, cfg, rewards, trained, adv, comps, mask, ent, acc, per_update, reward_logs)
    return row, None if bins is None else bins.row(step)


def record_update(
    acc: dict,
    per_update: dict,
    met: dict[str, float],
    *,
    policy_loss: float,
    grad_norm: float,
    grad_clip: float,
    ref_kl: float | None = None,
    head_norm: float | None = None,
    gated: bool | None = None,
    ratio_out: float | None = None,
) -> None:
    """Add one update's numbers to a step's accumulators (``acc``: sums over updates, in the order metrics.jsonl
    lists them; ``per_update``: nsr.policy_loss's metrics, reduced by nsr.METRIC_REDUCE). Both trainers (this one
    and experiments/tiny/batched.py) record through here, so their rows have one definition."""
    if ref_kl is not None:
        _add(acc, "ref_kl", ref_kl)
    if head_norm is not None:  # DGG
        _add(acc, "lm_head_grad_norm", head_norm)
        _add(acc, "dgg_gated", float(gated))
    if ratio_out is not None:
        _add(acc, "ratio_out_frac", ratio_out)
    _add(acc, "policy_loss", policy_loss)
    _add(acc, "grad_norm", grad_norm)
    _add(acc, "grad_clipped_frac", float(grad_norm > grad_clip))  # share of updates grad-clipped
    for k in nsr.METRIC_KEYS:
        per_update[k].append(met[k])


def step_row(step, cfg, rewards, trained, adv, comps, mask, ent, acc, per_update, reward_logs) -> dict:
    """The metrics.jsonl row of one RL step of one run (without wall_s), from its rollout (rewards, the reward
    trained on, advantages, completions, mask, entropy: tensors over its P x G samples) and its accumulators
    (:func:`record_update`)."""
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    updates = cfg.train.epochs * cfg.train.minibatches
    if "dgg_gated" in acc:
        acc["dgg_gated"] *= updates  # a count per step, not a mean
    grouped = trained.view(P, G)  # the reward trained on: groups with a signal
    distinct = sum(len(set(map(tuple, c.tolist()))) for c in comps.view(P, G, -1)) / (P * G)
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "entropy": (ent[mask].mean()).item(),
        "response_len": mask.sum(-1).float().mean().item(),
        **{k: v / updates for k, v in acc.items()},
        **{LOSS_METRICS.get(k, k): nsr.objectives.reduce_metric(k, per_update[k]) for k in _LOSS_ORDER},
        "adv_abs_mean": adv.abs().mean().item(),
        "mixed_group_frac": (grouped.max(1).values != grouped.min(1).values).float().mean().item(),
        "distinct_frac": distinct,
        **reward_logs,
    }


def _add(acc: dict, key: str, value: float) -> None:
    acc[key] = acc.get(key, 0.0) + value


def save_checkpoint(rd: RunDir, step: int, cfg: RunConfig, model: dict, optimizer: dict, gate, ws: str) -> None:
    """checkpoint.pt of a run at ``step``: its model (an HF state dict), its AdamW state dict, the DGG window and the
    sha256 of the warm start it started from; replaced atomically. One format for both trainers."""
    state = {"step": step, "run_hash": cfg.run_hash(), "model": model, "optimizer": optimizer}
    state["warm_start"] = ws  # the sha256 of the weights the run started from
    if gate is not None:
        state["dgg"] = gate.state_dict()
    with atomic_path(rd.checkpoint_path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(rd: RunDir, cfg: RunConfig, info: dict) -> dict:
    """The checkpoint a run resumes from, checked: RuntimeError if it belongs to another run or started from other
    warm-start weights (:func:`check_resume_weights`)."""
    ck = torch.load(rd.checkpoint_path, weights_only=True)
    if ck["run_hash"] != cfg.run_hash():
        raise RuntimeError(f"{rd.checkpoint_path} belongs to run {ck['run_hash']}, not {cfg.run_hash()}")
    check_resume_weights(ck.get("warm_start"), info, rd.path)
    return ck


def eval_due(cfg: RunConfig, step: int) -> bool:
    every = cfg.eval.every
    return step == cfg.train.steps or (every > 0 and step % every == 0)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    every, last = cfg.logging.checkpoint_every, cfg.train.steps
    return bool(every and step % every == 0 and step < last) or (step == last and cfg.logging.keep_checkpoint)


def train(
    cfg: RunConfig,
    rd: RunDir,
    progress: bool = True,
    *,
    dtype: torch.dtype | None = None,
    before_step: Callable[[int, torch.nn.Module, torch.optim.Optimizer], None] | None = None,
) -> None:
    """Run ``cfg`` on the tiny backend into ``rd``, resuming from ``rd.checkpoint_path`` if it exists.

    ``dtype``: tests only (None = float32, what every run uses): float64 for the engine-equivalence test of the
    batched trainer (tests/test_batched.py). ``before_step(step, model, optimizer)``: called before each RL step
    with the run's state after step - 1 (experiments.mechanism.toy tests rules there); it must leave both
    unchanged."""
    set_threads()
    progress = progress and cfg.logging.progress
    task = get_task(cfg.task.name)
    model, info = warm_policy(cfg, progress=progress, with_info=True)
    if dtype is not None:
        model.to(dtype)
    if rd.config_path.exists():  # experiments.run wrote it; a bare train() into a folder records nothing
        record_warm_start(rd, cfg, info)
    ref = None
    if cfg.train.kl_coef > 0:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    tr = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tr.adam_betas, weight_decay=tr.weight_decay)
    gate = GradientGate(tr.dgg_k, tr.dgg_window) if tr.dgg else None

    start = 0
    if rd.checkpoint_path.exists():
        ck = load_checkpoint(rd, cfg, info)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if gate is not None:
            gate.load_state_dict(ck["dgg"])
        start = ck["step"]
        rd.truncate_logs(start)
    else:
        rd.reset_logs()
        rd.append("eval.jsonl", evaluate(model, task, cfg, step=0))

    bar = tqdm(
        total=tr.steps, initial=start, desc=f"tiny {cfg.loss.rule} (sft {sft_key(cfg)[:6]})", disable=not progress
    )
    for step in range(start + 1, tr.steps + 1):
        if before_step is not None:
            before_step(step, model, opt)
        t0 = time.perf_counter()
        row, bins = rl_step(model, opt, task, cfg, step, ref, gate)
        row["wall_s"] = time.perf_counter() - t0
        rd.append("metrics.jsonl", [row])
        if bins is not None:
            rd.append("ratio_bins.jsonl", [bins])
        post = {
            "reward": f"{row['reward_mean']:.2f}",
            "ent": f"{row['entropy']:.2f}",
            "clip": f"{row['clip_frac']:.3f}",
        }
        if eval_due(cfg, step):
            rows = evaluate(model, task, cfg, step)
            rd.append("eval.jsonl", rows)
            post.update({f"eval_{k}": f"{v:.2f}" for k, v in summary(rows).items()})
        if checkpoint_due(cfg, step):
            save_checkpoint(rd, step, cfg, model.state_dict(), opt.state_dict(), gate, info["sha256"])
        bar.set_postfix(post, refresh=False)
        bar.update(1)
    bar.close()
    rd.compress_eval()
    if not cfg.logging.keep_checkpoint:
        rd.checkpoint_path.unlink(missing_ok=True)
