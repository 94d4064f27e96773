"""The toy Qwen2: one builder of a transformers ``Qwen2ForCausalLM`` at toy size in code (no hub), used by two models.

- ``tiny-qwen2`` (trl backend on the CPU testbed): on the testbed's 16-token vocabulary
  (experiments/tasks/countdown.py), tied embeddings, weights drawn from an explicit generator as the tiny GPT-2's, so
  the testbed's SFT warm start (experiments/sft.py, cached by the hash of the model and sft sections and the task
  name) trains it unchanged: importing this module registers it in the testbed's model registry
  (experiments/models/tiny.py). :func:`char_tokenizer` maps each character to the testbed's token id and EOS to 15
  (also the pad token), so TRL's prompts, completions and masks are the testbed's.
- ``cpu-tiny-qwen2`` (openrlhf backend on CPU, sweeps/presets/openrlhf-cpu.yaml): on a byte-level vocabulary, untied,
  RoPE theta exact in bf16, seeded from torch's global generator inside ``fork_rng``. It is built and warm-started
  once into :func:`model_dir` by experiments/openrlhf/toy.py; :func:`model_path` is what OpenRLHF and the math
  evaluator load.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from experiments.models.tiny import INIT_STD, MODELS
from experiments.rundir import cache_dir
from experiments.tasks.countdown import CHARS, EOS, N_POSITIONS, VOCAB_SIZE

EOS_TEXT = "<eos>"
TOY_MODELS = ("cpu-tiny-qwen2",)
"""model.name values of the openrlhf backend's toy model (built by experiments/openrlhf/toy.py). What switches a run
onto the CPU path is ``openrlhf.cpu``, not the model."""
BUILD_VERSION = 5
"""Bump when the CPU model's build changes its numbers, so a stale cached model is not reused."""


def toy_qwen2(
    mcfg: Any,
    *,
    vocab_size: int,
    max_positions: int,
    eos: int,
    tie: bool,
    generator: torch.Generator | None = None,
    rope_theta: float | None = None,
    sdpa: bool = False,
) -> torch.nn.Module:
    """A Qwen2 (RMSNorm, RoPE, SwiGLU, grouped KV heads: ``n_head // 2``) of ``mcfg.d_model`` x ``mcfg.n_layer``
    with ``mcfg.n_head`` heads, its EOS also BOS and pad.

    With ``generator``: weights normal(0, 0.02) redrawn from it, output projections scaled by 1/sqrt(2 n_layer) as in
    GPT-2, norms 1, biases 0. Without: transformers' own init from torch's global generator seeded 0 inside
    ``fork_rng`` (the caller's global state is given back untouched). ``rope_theta`` None keeps transformers' default.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM  # late: config validation imports this module

    extra = {"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}} if rope_theta is not None else {}
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=mcfg.d_model,
        intermediate_size=4 * mcfg.d_model,
        num_hidden_layers=mcfg.n_layer,
        num_attention_heads=mcfg.n_head,
        num_key_value_heads=max(1, mcfg.n_head // 2),
        max_position_embeddings=max_positions,
        **extra,
        tie_word_embeddings=tie,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        attention_dropout=0.0,
        use_cache=True,
    )
    if sdpa:
        config._attn_implementation = "sdpa"
    if generator is None:
        with torch.random.fork_rng(devices=[]):  # transformers draws the init from torch's global generator: seed it
            torch.manual_seed(0)  # here, and give the caller's global state back untouched
            model = Qwen2ForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    out_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
                    std = INIT_STD / math.sqrt(2 * mcfg.n_layer) if out_proj else INIT_STD
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
    model.generation_config.pad_token_id = eos
    model.generation_config.eos_token_id = eos
    return model


@MODELS.register("tiny-qwen2")
def tiny_qwen2(mcfg, generator: torch.Generator) -> torch.nn.Module:
    """The testbed's Qwen2 (tied embeddings, the testbed's vocabulary and context), initialised from ``generator``."""
    return toy_qwen2(
        mcfg, vocab_size=VOCAB_SIZE, max_positions=N_POSITIONS, eos=EOS, tie=True, generator=generator, sdpa=True
    )


def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` over the testbed's characters: one token per character, ids as the testbed's,
    ``<eos>`` = 15 as EOS and pad; decoding joins the characters without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)} | {EOS_TEXT: EOS}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    special = {"bos_token": EOS_TEXT, "eos_token": EOS_TEXT, "pad_token": EOS_TEXT, "unk_token": EOS_TEXT}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


# ---------------------------------------------------------------- where the CPU model lives
def is_toy_model(cfg) -> bool:
    return cfg.model.name in TOY_MODELS


def model_key(cfg) -> str:
    """16 hex of sha256 over the build version and the model section."""
    blob = json.dumps({"version": BUILD_VERSION, "model": cfg.to_dict()["model"]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_dir(cfg) -> Path:
    return cache_dir() / "openrlhf-cpu" / f"{cfg.model.name}-{model_key(cfg)}"


def model_path(cfg) -> str:
    """What OpenRLHF and the evaluator load: the built folder for the toy model, SmolLM2's prepared folder for
    ``smollm2-135m-instruct`` (an untied copy's with ``model.untie_embeddings``), else ``model.name`` (a hub id or a
    local folder). Pure: builds nothing (experiments/openrlhf/toy.py and the backend's ``prepared_folder`` do)."""
    if is_toy_model(cfg):
        return str(model_dir(cfg))
    from experiments.models.smollm2 import folder_for

    return str(folder_for(cfg.model.name, untie=cfg.model.untie_embeddings))
