"""Many tiny runs in one process: S runs trained as one batched model (experiments/tiny/batched_model.py).

    python -m experiments.run sweeps/presets/tiny.yaml loss.rule=nsr --seeds 0-7 --out /tmp/nsr-seeds

trains seeds 0-7 in one batch, one run folder per seed (``<config stem>-s<seed>-<run hash>`` under ``--out``); a
library caller (a submitter packing runs) calls :func:`experiments.run.run_batch` for any list of compatible configs
(folders locked, checked and given their status by experiments.run), or :func:`train_batch` for the trainer alone.

What a batch shares and what its runs may not: :func:`batch_key` is the compatibility key, the fields of
:data:`SHARED` (backend, model shape, task, rollout sizes, train.steps, train.epochs x train.minibatches and the eval
section); :func:`check_batch` refuses a set of configs that differ in one, naming the field. Everything else may
differ from run to run: seed, the sft section (each run loads its own warm start), loss and advantages, the reward
source, lr, betas, weight decay, grad_clip, agg_mode, entropy_coef, kl_coef, DGG and the logging section.

Each run is today's run (experiments/tiny/train.py) in every number it draws: its rollout, advantage, shuffle and loss
generators are ``nsr.seeds.generator(seed, step, purpose)`` drawn in the single-run order (``task.sample_train`` then
one ``torch.multinomial`` per new token on its own generator), its eval sampling uses ``(eval.seed, step, "eval")``,
its loss, advantages and metrics are computed by the same functions on its own tensors, its AdamW and gradient
clipping use its own hyperparameters, and its rows are built by the single-run trainer's own
:func:`~experiments.tiny.train.record_update` and :func:`~experiments.tiny.train.step_row`. Only the model's
arithmetic is batched, so float sums run in another order: in float64 a run of a batch of 8 and the single-run
trainer agree to 1e-9 over 10 steps with the same sampled tokens (tests/test_batched.py); in float32, one step
agrees within float32 rounding and long runs drift apart as RL amplifies it (docs/testbed.md, "Batched testbed").

Each run writes today's run-folder contract into its own folder: config.yaml (``meta.warm_start``), metrics.jsonl
(the single-run keys, in its order; ``wall_s`` is the batched step's time, shared by the runs of the batch),
eval.jsonl(.gz), ratio_bins.jsonl(.gz) and checkpoint.pt in the single-run format (an HF state dict and an AdamW
state dict, plus the warm start's sha256). A killed batch resumes every run from its own checkpoint; runs whose
checkpoints are at different steps wait (inactive, no draw, no update) until the batch reaches theirs. A run that
fails (an exception in its sampling, e.g. NaN weights, in its rewards or advantages, in its loss, or in its logs)
fails alone: its status is failed, its slot is zeroed, and the others continue.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback

import torch
from tqdm import tqdm

import nsr
from experiments.config import ConfigError, RunConfig, project
from experiments.evaluation.testbed import eval_rows, summary
from experiments.models.tiny import response_mask
from experiments.rundir import RunDir
from experiments.sft import record_warm_start, sft_key, warm_start
from experiments.tasks.countdown import Task, get_task
from experiments.threads import set_threads
from experiments.tiny.batched_model import WTE, BatchedAdamW, BatchedGPT2, MemberView, clip_grad_norms
from experiments.tiny.rewards import train_rewards
from experiments.tiny.train import (
    checkpoint_due,
    eval_due,
    load_checkpoint,
    record_update,
    save_checkpoint,
    step_row,
)
from nsr.gating import GradientGate
from nsr.premise import PremiseMeter, token_ratio
from nsr.seeds import generator

SHARED = ("backend", "model", "task.name", "rollout", "train.steps", "train.epochs", "train.minibatches", "eval")
"""The fields every run of a batch has in common (dotted; a section stands for all its fields)."""
MAX_EVAL_SEQUENCES = 2**15
"""Sequences generated at once in a batched eval (members are evaluated in chunks below this)."""


# ------------------------------------------------------------------ compatibility
def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def batch_key(cfg: RunConfig) -> str:
    """The compatibility key of a run: 12 hex of sha256 over its :data:`SHARED` fields. Runs with equal keys can be
    trained in one batch. ConfigError for a backend other than tiny."""
    allowed = "tiny (the batched trainer is the tiny backend's)"
    if cfg.backend != "tiny":
        raise ConfigError(f"backend={cfg.backend!r} is not valid in a batch; allowed: {allowed}")
    blob = json.dumps(project(cfg.to_dict(), SHARED), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def check_batch(cfgs: list[RunConfig]) -> None:
    """ConfigError unless ``cfgs`` can train in one batch: at least one, all tiny, equal in every field of
    :data:`SHARED` (the error names the first field that differs and both values), no config twice."""
    if not cfgs:
        raise ConfigError("a batch needs at least one run")
    keys = [batch_key(c) for c in cfgs]
    first = dict(_leaves(project(cfgs[0].to_dict(), SHARED)))
    for i, (cfg, key) in enumerate(zip(cfgs, keys)):
        if key == keys[0]:
            continue
        for field, value in _leaves(project(cfg.to_dict(), SHARED)):
            if value != first[field]:
                raise ConfigError(
                    f"{field}={value!r} (run {i}) differs from {first[field]!r} (run 0); runs in one batch share "
                    f"{', '.join(SHARED)}; allowed: the same {field} in every run of the batch"
                )
    seen: dict[str, int] = {}
    for i, cfg in enumerate(cfgs):
        h = cfg.run_hash()
        if h in seen:
            raise ConfigError(f"run {i} is the config of run {seen[h]} (hash {h}); allowed: each config once")
        seen[h] = i


# ------------------------------------------------------------------ one RL step of every run
class _Failures(dict):
    """{member: (exception, traceback text)} of the members that failed during a step."""

    def catch(self, s: int, e: BaseException) -> None:
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit, Cancelled: the batch stops
            raise e
        self.setdefault(s, (e, traceback.format_exc()[-4000:]))


def batch_rl_step(
    model: BatchedGPT2,
    opt: BatchedAdamW,
    task: Task,
    cfgs: list[RunConfig],
    step: int,
    active: list[int],
    ref: dict | None = None,
    gates: list[GradientGate | None] | None = None,
    failures: _Failures | None = None,
    trace: dict | None = None,
) -> dict[int, tuple[dict, dict | None]]:
    """One RL step of the ``active`` members: {member: (metrics row without wall_s, ratio_bins row or None)} as
    :func:`experiments.tiny.train.rl_step` returns them for each run. Members that fail are left out of the result
    and recorded in ``failures``; the other members are not affected. ``trace`` (tests): gets each member's rollout
    completions under ``trace[member]``.

    On a model on another device than the CPU (experiments/bench/gpu.py) the model's work runs there and the draws
    that touch its tensors (sampling, the loss's noise) come from generators on that device seeded as the CPU ones:
    other numbers than a CPU run's, for throughput, not for the grids."""
    failures = _Failures() if failures is None else failures
    gates = gates or [None] * model.S
    c0 = cfgs[active[0]]
    ro, tr0 = c0.rollout, c0.train
    P, G = ro.prompts_per_step, ro.samples_per_prompt
    N, S = P * G, model.S
    dev = model.device
    on_cpu = dev.type == "cpu"
    groups = torch.arange(P).repeat_interleave(G)

    # rollout: each member's prompts and samples from its own generator, in the single-run order
    ids: dict[int, torch.Tensor] = {}
    prompts = torch.zeros(S, P, task.prompt_len, dtype=torch.long)  # each member's P prompts, G samples each
    gens: list[torch.Generator | None] = [None] * S
    for s in active:
        g_roll = generator(cfgs[s].seed, step, "rollout")
        pids = task.sample_train(P, g_roll)
        gens[s] = g_roll if on_cpu else generator(cfgs[s].seed, step, "rollout", device=dev)
        ids[s] = pids.repeat_interleave(G)
        prompts[s] = task.prompts(pids)
    for s in range(S):  # inactive members decode the first member's prompts greedily (no draw); nothing is kept
        if s not in ids:
            prompts[s] = prompts[active[0]]
    prompts = prompts.to(dev)
    comps = model.generate(model.params, prompts, ro.max_new_tokens, ro.temperature, gens, group=G, errors=failures)
    mask = response_mask(comps)
    seq_prompt = torch.arange(N, device=dev) // G  # sample j of a rollout continues prompt j // G
    live = [s for s in active if s not in failures]
    host = {"comps": comps.cpu(), "mask": mask.cpu(), "prompts": prompts.cpu()}  # no copy on the CPU
    if trace is not None:
        trace.update({s: host["comps"][s].clone() for s in live})

    rewards, trained, adv, reward_logs = {}, {}, {}, {}
    for s in live:
        try:
            cfg = cfgs[s]
            c, m = host["comps"][s], host["mask"][s]
            rewards[s] = task.rewards(ids[s], c)
            trained[s], reward_logs[s] = train_rewards(
                cfg.reward.source, rewards[s], task, MemberView(model, s), host["prompts"][s].repeat_interleave(G, 0),
                c, m, groups, ro.temperature,
            )  # fmt: skip
            adv[s] = nsr.compute_advantages(
                trained[s], groups, cfg.advantages, generator=generator(cfg.seed, step, "adv")
            ).to(dev)
        except Exception as e:
            failures.catch(s, e)
    live = [s for s in live if s not in failures]
    # the old log-probs by the forward the updates use: at the first update log r is exactly 0, as in a single run
    with torch.no_grad():
        every = seq_prompt.expand(S, N)
        old_logp, ent = model.logprobs(model.params, prompts, comps, ro.temperature, with_entropy=True, prefix=every)
        ref_logp = None
        if ref is not None and any(cfgs[s].train.kl_coef > 0 for s in live):
            ref_logp = model.logprobs(ref, prompts, comps, ro.temperature, prefix=every)[0]

    # updates: each member's own minibatch order and loss generator; one batched forward and backward per update
    perms: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    g_loss: dict[int, torch.Generator] = {}
    bins: dict[int, PremiseMeter | None] = {}
    for s in live:
        g_shuffle = generator(cfgs[s].seed, step, "shuffle")
        perms[s] = [torch.randperm(N, generator=g_shuffle).chunk(tr0.minibatches) for _ in range(tr0.epochs)]
        g_loss[s] = generator(cfgs[s].seed, step, "loss", device=dev)
        bins[s] = PremiseMeter(cfgs[s].loss, device=dev) if cfgs[s].loss.level == "token" else None
    with_ent = any(cfgs[s].train.entropy_coef > 0 for s in live)
    n_mb = N // tr0.minibatches
    filler = torch.arange(n_mb)
    updates: dict[int, list[dict]] = {s: [] for s in live}
    update = 0
    for epoch in range(tr0.epochs):
        for j in range(tr0.minibatches):
            if not live:
                break
            idx = torch.stack([perms[s][epoch][j] if s in perms and s in live else filler for s in range(S)]).to(dev)
            logp, mb_ent = model.logprobs(
                model.params, prompts, _take(comps, idx), ro.temperature, with_entropy=with_ent, prefix=seq_prompt[idx]
            )
            m_all, old_all, ref_all = _take(mask, idx), _take(old_logp, idx), None
            if ref_logp is not None:
                ref_all = _take(ref_logp, idx)
            losses, tok, rec = [], [], {}
            for s in live:
                try:
                    cfg, tr, mb = cfgs[s], cfgs[s].train, idx[s]
                    m, lp = m_all[s], logp[s]
                    loss_tok, met = nsr.policy_loss(lp, old_all[s], adv[s][mb], m, cfg.loss, generator=g_loss[s])
                    r = None
                    if bins[s] is not None:
                        r = token_ratio(lp, old_all[s])
                        tok.append((s, loss_tok, r, adv[s][mb], m))
                    pg_loss = nsr.aggregate(loss_tok, m, tr.agg_mode)
                    loss = pg_loss
                    if tr.entropy_coef > 0:
                        loss = loss - tr.entropy_coef * nsr.aggregate(mb_ent[s], m, tr.agg_mode)
                    kl = None
                    if ref_all is not None and tr.kl_coef > 0:
                        d = ref_all[s] - lp  # k3 estimator of KL(pi || pi_ref), as the single-run trainer
                        kl = nsr.aggregate(d.exp() - d - 1, m, tr.agg_mode)
                        loss = loss + tr.kl_coef * kl
                    losses.append(loss)
                    rec[s] = {"met": met, "pg": pg_loss.detach(), "kl": None if kl is None else kl.detach(), "r": r}
                except Exception as e:
                    failures.catch(s, e)
            ok = [s for s in live if s in rec]
            tok = [t for t in tok if t[0] in rec]
            if tok:  # d loss_t / d log pi_t of every token-level member at once (members do not mix)
                (grad,) = torch.autograd.grad(sum(t[1].sum() for t in tok), logp, retain_graph=True)
                for s, loss_tok, r, a, m in tok:
                    try:  # the counts stay on the model's device until the step's row (no sync per update)
                        bins[s].add(loss_tok.detach(), logp[s].detach(), a, m, ratio=r, grad=grad[s])
                    except Exception as e:
                        failures.catch(s, e)
            model.zero_grad()
            if losses:
                sum(losses).backward()
            ok = [s for s in ok if s not in failures]
            gated = {s: None for s in ok}
            head = {}
            if any(gates[s] is not None for s in ok):  # DGG: each member's tied output matrix, before clipping
                norms = torch.linalg.vector_norm(model.params[WTE].grad.float(), dim=(1, 2)).tolist()
                for s in ok:
                    if gates[s] is not None:
                        head[s] = norms[s]
                        gated[s] = gates[s].gate(norms[s], first=update == 0)
            update += 1
            grad_norm = clip_grad_norms(model, [c.train.grad_clip for c in cfgs])
            opt.step([s for s in ok if not gated[s]])
            for s in ok:
                x = rec[s]
                vals = [x["met"][k] for k in nsr.METRIC_KEYS] + [x["pg"], grad_norm[s]]
                if x["kl"] is not None:
                    vals.append(x["kl"])
                if x["r"] is not None:  # token ratios outside the region, either side (clipped or not)
                    m, r = m_all[s], x["r"]
                    vals.append(((r[m] < cfgs[s].loss.low) | (r[m] > cfgs[s].loss.high)).float().mean())
                x["vals"] = torch.stack([v.to(torch.float64) for v in vals])  # exact: float32 values fit float64
                x["head"], x["gated"] = head.get(s), gated[s]
                updates[s].append(x)
            live = [s for s in live if s not in failures]

    result = {}
    ent = ent.cpu()
    for s in live:
        try:
            acc: dict[str, float] = {}
            per_update: dict[str, list[float]] = {k: [] for k in nsr.METRIC_KEYS}
            table = torch.stack([x["vals"] for x in updates[s]]).tolist()  # one read per run and step
            n = len(nsr.METRIC_KEYS)
            for x, v in zip(updates[s], table):
                rest = iter(v[n + 2 :])
                kl = next(rest) if x["kl"] is not None else None
                record_update(
                    acc,
                    per_update,
                    dict(zip(nsr.METRIC_KEYS, v[:n])),
                    policy_loss=v[n],
                    grad_norm=v[n + 1],
                    grad_clip=cfgs[s].train.grad_clip,
                    ref_kl=kl,
                    head_norm=x["head"],
                    gated=x["gated"],
                    ratio_out=next(rest) if x["r"] is not None else None,
                )
            row = step_row(
                step, cfgs[s], rewards[s], trained[s], adv[s].cpu(), host["comps"][s], host["mask"][s], ent[s], acc,
                per_update, reward_logs[s],
            )  # fmt: skip
            result[s] = (row, None if bins[s] is None else bins[s].row(step))
        except Exception as e:
            failures.catch(s, e)
    return result


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (S, N, ...) rows idx (S, n) of each member -> (S, n, ...)."""
    index = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:])
    return torch.gather(x, 1, index)


# ------------------------------------------------------------------ eval of several members
def batch_evaluate(
    model: BatchedGPT2, task: Task, cfg: RunConfig, step: int, members: list[int], failures: _Failures | None = None
) -> dict[int, list[dict]]:
    """experiments.evaluation.testbed.evaluate for each of ``members`` (they share the eval section): {member: rows}.
    Sampled decoding gives every member its own generator seeded by (eval.seed, step, "eval"), as a single run."""
    failures = _Failures() if failures is None else failures
    e = cfg.eval
    ids = task.eval_set(e.n_prompts, e.seed)
    rows: dict[int, list[dict]] = {s: [] for s in members}
    if len(ids) == 0 or not members:
        return rows
    prompts = task.prompts(ids).to(model.device)
    max_new = cfg.rollout.max_new_tokens
    decodings = []
    if e.greedy:
        decodings.append(("greedy", 1))
    if e.n_samples:
        decodings.append(("sampled", e.n_samples))
    for decoding, k in decodings:
        per = max(1, MAX_EVAL_SEQUENCES // (len(ids) * k))
        for i in range(0, len(members), per):
            chunk = [s for s in members[i : i + per] if s not in failures]
            if not chunk:
                continue
            params = model.params if chunk == list(range(model.S)) else model.subset(chunk)
            p = prompts.unsqueeze(0).expand(len(chunk), -1, -1)
            errors = _Failures()
            if decoding == "greedy":
                comps = model.generate(params, p, max_new, greedy=True)
            else:  # the prompts repeated n_samples times in a row (repeat_interleave) (as evaluation.testbed)
                gens = [generator(e.seed, step, "eval", device=model.device) for _ in chunk]
                comps = model.generate(params, p, max_new, e.temperature, gens, group=k, errors=errors)
            comps = comps.cpu()
            for c, s in enumerate(chunk):
                if c in errors:
                    failures.setdefault(s, errors[c])
                    continue
                try:
                    rows[s] += eval_rows(task, step, decoding, ids, comps[c], k)
                except Exception as err:
                    failures.catch(s, err)
    return {s: r for s, r in rows.items() if s not in failures}


# ------------------------------------------------------------------ the trainer
def train_batch(
    cfgs: list[RunConfig],
    folders: list,
    *,
    progress: bool = True,
    dtype: torch.dtype | None = None,
    trace: dict | None = None,
    device: str | torch.device = "cpu",
) -> dict[int, tuple[BaseException, str]]:
    """Train ``cfgs`` (compatible: :func:`check_batch`) as one batch, run ``i`` into ``folders[i]`` (paths or
    RunDirs), each resuming from its own checkpoint if it has one. Returns {run index: (exception, traceback)} of the
    runs that failed (each failed alone: its status.json says failed when the folder has a config.yaml, the others
    went on). An exception that is no run's (an interrupt, an error in the batched forward) propagates.

    ``dtype`` and ``trace``: tests only (float64 for the engine-equivalence test; ``trace[(run, step)]`` gets each
    run's rollout completions). ``device``: where the model computes (the CPU for every committed run; a GPU draws
    other numbers, see :func:`batch_rl_step`)."""
    check_batch(cfgs)
    if len(folders) != len(cfgs):
        raise ValueError(f"{len(cfgs)} configs and {len(folders)} folders; allowed: one folder per config")
    rds = [f if isinstance(f, RunDir) else RunDir(f) for f in folders]
    if len({rd.path.resolve() for rd in rds}) != len(rds):
        raise ValueError("two runs of the batch share a folder; allowed: one folder per run")
    set_threads()
    S, c0 = len(cfgs), cfgs[0]
    progress = progress and c0.logging.progress
    task = get_task(c0.task.name)
    warm: dict[str, tuple[dict, dict]] = {}
    infos = []
    for cfg, rd in zip(cfgs, rds):
        key = sft_key(cfg)
        if key not in warm:
            warm[key] = warm_start(cfg, progress)
        infos.append(warm[key][1])
        if rd.config_path.exists():  # experiments.run wrote it; a bare train_batch into a folder records nothing
            record_warm_start(rd, cfg, warm[key][1])
            rd.update_meta(engine={"trainer": "batched", "runs": len(cfgs)})  # provenance, not identity
    model = BatchedGPT2(c0.model, [warm[sft_key(c)][0] for c in cfgs], dtype or torch.float32, device)
    ref = model.detached() if any(c.train.kl_coef > 0 for c in cfgs) else None
    opt = BatchedAdamW(
        model, [c.train.lr for c in cfgs], [c.train.adam_betas for c in cfgs], [c.train.weight_decay for c in cfgs]
    )
    gates = [GradientGate(c.train.dgg_k, c.train.dgg_window) if c.train.dgg else None for c in cfgs]
    failed: dict[int, tuple[BaseException, str]] = {}

    def fail(found: dict) -> None:
        for s, (e, tb) in found.items():
            if s in failed:
                continue
            failed[s] = (e, tb)
            with torch.no_grad():  # nothing of a failed run circulates (NaN weights stay in their slot anyway)
                model.flat[s].zero_()
                opt.exp_avg[s].zero_()
                opt.exp_avg_sq[s].zero_()
            if rds[s].config_path.exists():
                rds[s].set_status("failed", error=f"{type(e).__name__}: {e}", traceback=tb)

    starts = [0] * S
    fresh = []
    setup = _Failures()
    for s, (cfg, rd) in enumerate(zip(cfgs, rds)):
        try:
            rd.path.mkdir(parents=True, exist_ok=True)
            if rd.checkpoint_path.exists():
                ck = load_checkpoint(rd, cfg, infos[s])
                model.load_member(s, ck["model"])
                opt.load_member_state_dict(s, ck["optimizer"])
                if gates[s] is not None:
                    gates[s].load_state_dict(ck["dgg"])
                starts[s] = ck["step"]
                rd.truncate_logs(starts[s])
            else:
                rd.reset_logs()
                fresh.append(s)
        except Exception as e:
            setup.catch(s, e)
    fail(setup)
    found = _Failures()
    for s, rows in batch_evaluate(model, task, c0, 0, [s for s in fresh if s not in failed], found).items():
        _write(rds[s], "eval.jsonl", rows, s, found)
    fail(found)

    alive = [s for s in range(S) if s not in failed]
    first = min((starts[s] for s in alive), default=c0.train.steps)
    bar = tqdm(total=c0.train.steps, initial=first, desc=f"tiny batch x{S}", disable=not progress)
    for step in range(first + 1, c0.train.steps + 1):
        active = [s for s in range(S) if s not in failed and starts[s] < step]
        if not active:
            break
        found = _Failures()
        t0 = time.perf_counter()
        steps = {} if trace is not None else None
        out = batch_rl_step(model, opt, task, cfgs, step, active, ref, gates, found, steps)
        wall = time.perf_counter() - t0
        if trace is not None:
            trace.update({(s, step): c for s, c in steps.items()})
        for s, (row, bins) in out.items():
            row["wall_s"] = wall
            _write(rds[s], "metrics.jsonl", [row], s, found)
            if bins is not None:
                _write(rds[s], "ratio_bins.jsonl", [bins], s, found)
        due = [s for s in out if s not in found and eval_due(cfgs[s], step)]
        evals = batch_evaluate(model, task, c0, step, due, found) if due else {}
        for s, rows in evals.items():
            _write(rds[s], "eval.jsonl", rows, s, found)
        for s in out:
            if s not in found and checkpoint_due(cfgs[s], step):
                try:
                    save_checkpoint(rds[s], step, cfgs[s], model.member_state(s), opt.member_state_dict(s), gates[s],
                                    infos[s]["sha256"])  # fmt: skip
                except Exception as e:
                    found.catch(s, e)
        fail(found)
        if progress:
            post = {"runs": f"{len(out) - len(set(out) & set(found))}/{S}"}
            if evals:
                acc = [summary(r).get("greedy", 0.0) for r in evals.values()]
                post["eval_greedy"] = f"{sum(acc) / len(acc):.2f}"
            bar.set_postfix(post, refresh=False)
        bar.update(1)
    bar.close()
    for s in range(S):
        if s in failed:
            continue
        try:
            rds[s].compress_eval()
            if not cfgs[s].logging.keep_checkpoint:
                rds[s].checkpoint_path.unlink(missing_ok=True)
        except Exception as e:
            fail({s: (e, traceback.format_exc()[-4000:])})
    return failed


def _write(rd: RunDir, name: str, rows: list[dict], s: int, failures: _Failures) -> None:
    try:
        rd.append(name, rows)
    except Exception as e:
        failures.catch(s, e)


# ------------------------------------------------------------------ the command line's pieces (experiments.run)
def parse_seeds(text: str) -> list[int]:
    """``--seeds`` of experiments.run: ``0-7``, ``0,3,5`` or ``0-3,8`` -> distinct seeds in the order given.
    ConfigError naming the option and the allowed values."""
    allowed = "a list like 0-7, 0,3,5 or 0-3,8 of distinct integers >= 0"
    seeds: list[int] = []
    try:
        for part in str(text).split(","):
            a, sep, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if sep else int(a)
            if lo < 0 or hi < lo:
                raise ValueError
            seeds += range(lo, hi + 1)
    except ValueError:
        raise ConfigError(f"--seeds {text!r} is not valid; allowed: {allowed}") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r} is not valid (a seed twice); allowed: {allowed}")
    return seeds


def seed_run_id(stem: str, cfg: RunConfig) -> str:
    """The run id (and folder name) of one seed of ``python -m experiments.run CONFIG --seeds ...``:
    ``<config stem>-s<seed>-<run hash>`` (the single-run CLI's ``<config stem>-<run hash>`` with the seed)."""
    return f"{stem}-s{cfg.seed}-{cfg.run_hash()}"
