"""The trl backend's replay part of the paired per-update test (experiments.mechanism.trl, docs/mechanism.md): saving,
replaying and restoring one RL step of NSRGRPOTrainer in memory.

* :func:`snapshot` / :func:`restore`: weights, AdamW and scheduler state, every RNG state, the trainer's metric buffers
  and premise meter, micro-step and optimizer-step counters, copied in host memory and put back exactly;
* :func:`replay`: one RL step's updates with another rule on the trainer's buffered rollout, as transformers' loop
  does them (NSRGRPOTrainer.replaying: no generation); :func:`optimizer_steps`: any number of its optimizer steps
  (experiments.trl.precision);
* :func:`clipped_weight`, :func:`weights_digest`, :func:`update_norm`: what an update did (its dose, the weights it
  left, how far it moved them).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Snapshot:
    """What one RL step's updates change in an NSRGRPOTrainer, copied (host memory)."""

    weights: dict
    optimizer: dict
    scheduler: dict
    rng: tuple
    metrics: dict
    premise: object
    step: int
    global_step: int
    loss: object
    accumulation: int
    sync_gradients: bool
    step_time: float


def snapshot(tr) -> Snapshot:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return Snapshot(
        weights={k: v.detach().clone() for k, v in tr.model.state_dict().items()},
        optimizer=copy.deepcopy(tr.optimizer.state_dict()),
        scheduler=copy.deepcopy(tr.lr_scheduler.state_dict()),
        rng=(torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()),
        metrics=copy.deepcopy(tr._metrics),
        premise=copy.deepcopy(tr.premise),
        step=tr._step,
        global_step=tr.state.global_step,
        loss=tr.nsr_loss,
        accumulation=tr.current_gradient_accumulation_steps,
        sync_gradients=tr.accelerator.gradient_state.sync_gradients,
        step_time=tr._current_train_step_time,
    )


def restore(tr, snap: Snapshot) -> None:
    """Put ``snap`` back exactly (the optimizer state from a fresh copy: load_state_dict keeps the tensors it gets)."""
    tr.model.zero_grad()
    tr.model.load_state_dict(snap.weights)
    tr.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
    tr.lr_scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
    cpu, cuda, py, npy = snap.rng
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)
    tr._metrics = copy.deepcopy(snap.metrics)
    tr.premise = copy.deepcopy(snap.premise)
    tr._step, tr.state.global_step, tr.nsr_loss = snap.step, snap.global_step, snap.loss
    tr.current_gradient_accumulation_steps = snap.accumulation
    tr.accelerator.gradient_state._set_sync_gradients(snap.sync_gradients)
    tr._current_train_step_time = snap.step_time


def replay(tr, loss) -> dict[str, float]:
    """One RL step's updates with rule ``loss`` on the trainer's buffered rollout, as transformers' Trainer loop does
    them (its training_step per micro-batch; at each accumulation boundary the gradient clip, the optimizer step, the
    scheduler step, zero_grad and global_step + 1). Returns the update's clip_frac, rescue_frac (means over its
    micro-batches), grad_norm (mean over its optimizer steps) and dose (:func:`clipped_weight`). The trainer is left
    changed: restore() it."""
    start = {k: len(v) for k, v in tr._metrics["train"].items()}
    weight0, tokens0 = clipped_weight(tr)
    tr.nsr_loss = loss
    norms = optimizer_steps(tr, tr.args.steps_per_generation * tr.num_iterations // tr.args.gradient_accumulation_steps)

    def new(key):
        return tr._metrics["train"][key][start.get(key, 0) :]

    weight, tokens = clipped_weight(tr)
    return {
        "clip_frac": float(np.mean(new("nsr/clip_frac"))),
        "rescue_frac": float(np.mean(new("nsr/rescue_frac"))),
        "grad_norm": float(np.mean(norms)) if norms else math.nan,
        "dose": (weight - weight0) / (tokens - tokens0) if tokens > tokens0 else math.nan,
    }


def optimizer_steps(tr, n: int) -> list[float]:
    """``n`` optimizer steps on the trainer's buffered rollout, as transformers' Trainer loop takes them: the
    gradient_accumulation_steps micro-batches of each in the order the run reads them (the buffered micro-batch of
    ``tr._step``, which each training_step advances), then at the accumulation boundary the gradient clip, the
    optimizer step, the scheduler step, zero_grad and global_step + 1. Returns the pre-clip gradient norms (none
    without a clip)."""
    ga = tr.args.gradient_accumulation_steps
    model = tr.model_wrapped if tr.model_wrapped is not None else tr.model
    norms = []
    tr.replaying = True
    try:
        for i in range(n * ga):
            tr.current_gradient_accumulation_steps = ga
            boundary = (i + 1) % ga == 0
            tr.accelerator.gradient_state._set_sync_gradients(boundary)
            tr.training_step(model, {}, None)  # TRL's GRPO batches carry no labels: num_items_in_batch is None
            if boundary:
                if tr.args.max_grad_norm > 0:
                    norms.append(float(tr._clip_grad_norm(model)))
                tr.optimizer.step()
                tr.lr_scheduler.step()
                model.zero_grad()
                tr.state.global_step += 1
    finally:
        tr.replaying = False
    return norms


def clipped_weight(tr) -> tuple[float, float]:
    """(gradient weight the premise meter has seen on clipped tokens, valid tokens it has seen) in its current window;
    (nan, 0) without a meter. The dose of an update (the toy's, experiments.mechanism.toy._dose) is the change of
    the first over the change of the second: the weight on clipped tokens relative to the unclipped gradient, per
    valid token."""
    if tr.premise is None:
        return math.nan, 0.0
    return float(tr.premise.counts()[:, 2].sum()), float(tr.premise.tokens)


def weights_digest(model) -> str:
    """The first 16 hex digits of the weights' sha256 as a run records it (experiments.models.smollm2.weights_sha256):
    equal digests, identical weights."""
    from experiments.models.smollm2 import weights_sha256

    return weights_sha256(model)[:16]


def update_norm(model, before: dict) -> float:
    """L2 norm of the weight change from ``before`` (a state dict) to ``model``'s parameters."""
    total = 0.0
    for name, p in model.named_parameters():
        total += float((p.detach() - before[name]).double().pow(2).sum())
    return math.sqrt(total)
