"""Recorded rollout batches of an OpenRLHF run (``--nsr.record_steps``, ``--nsr.record_dir``; the kit's
``logging.record_batches``): what a policy rank trained on at an RL step, written before its first update, so the
step's updates can be replayed offline, e.g. in another precision.

One file per recorded step and data-parallel rank, ``<record_dir>/step<N>-rank<R>.pt`` (torch.save; read it with
:func:`read_batch`, which loads tensors only), holding:

* ``samples``: the rank's replay-buffer items in buffer order, one dict per sample with the tensors OpenRLHF trains
  on (padding removed, as its buffer holds them): ``sequences``, ``attention_mask``, ``action_mask``,
  ``action_log_probs`` (the old log-probs the ratios divide by), ``rollout_log_probs`` (vLLM's, where kept),
  ``advantages``, ``rewards``, ``scores``, ``response_length``, ``truncated``; a field the item lacks is left out;
* ``rng_state``: torch's global RNG state before the step's training, from which OpenRLHF's minibatch DataLoader
  draws its shuffle (set it, build the same DataLoader over the same items, and the order repeats);
* ``step``, ``rank``, ``sample_batch_size`` (samples per micro-batch), ``version``.

The file is written to a temporary name and renamed, so a crash never leaves half a file; a step trained again after
a resume overwrites the step's file with the batch that run trained on.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VERSION = 1
FIELDS = (
    "sequences",
    "attention_mask",
    "action_mask",
    "action_log_probs",
    "rollout_log_probs",
    "advantages",
    "rewards",
    "scores",
    "response_length",
    "truncated",
)


def batch_path(record_dir: str | Path, step: int, rank: int) -> Path:
    return Path(record_dir) / f"step{step}-rank{rank}.pt"


def write_batch(record_dir: str | Path, step: int, rank: int, items, sample_batch_size: int) -> Path:
    """Write the replay-buffer ``items`` (OpenRLHF Experiences, one sample each) of RL step ``step``; returns the
    file. Call it before the step's training, so ``rng_state`` is the state its shuffle draws from."""
    samples = []
    for item in items:
        row = {}
        for name in FIELDS:
            value = getattr(item, name, None)
            if isinstance(value, torch.Tensor):
                row[name] = value.detach().to("cpu").clone()
        samples.append(row)
    payload = {
        "version": VERSION,
        "step": int(step),
        "rank": int(rank),
        "sample_batch_size": int(sample_batch_size),
        "rng_state": torch.get_rng_state(),
        "samples": samples,
    }
    path = batch_path(record_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def read_batch(path: str | Path) -> dict:
    """A file :func:`write_batch` wrote (tensors, lists, dicts and numbers only: ``weights_only``)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("version") != VERSION:
        raise ValueError(f"{path}: recorded-batch version {payload.get('version')!r}; this code reads {VERSION}")
    return payload
