"""The tiny policy: a transformers GPT-2 at toy size, built in code (no hub access), plus sampling and log-probs.

Using transformers' own ``GPT2LMHeadModel`` keeps the code path of real models (HF forward, SDPA attention,
KV cache, tied embeddings); at d_model 64 x 2 layers it has about 0.1M parameters. Generation uses the KV cache:
measured (docs/testbed.md) it makes the transformers rollout faster than a plain-torch model without cache.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from experiments.tasks.countdown import EOS, N_POSITIONS, VOCAB_SIZE
from nsr.registry import Registry

if TYPE_CHECKING:  # annotations only: config validation imports this module
    from experiments.config import ModelConfig

INIT_STD = 0.02  # GPT-2's initializer_range

MODELS: Registry = Registry("model.name")


@MODELS.register("tiny-gpt2")
def tiny_gpt2(mcfg: ModelConfig, generator: torch.Generator) -> torch.nn.Module:
    """A GPT-2 (pre-LN, learned positions, tied embeddings, no dropout) initialised from ``generator``.

    The init is GPT-2's (normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), LayerNorm 1/0, biases
    0), redrawn from the explicit generator so a warm start does not depend on torch's global RNG.
    """
    from transformers import GPT2Config, GPT2LMHeadModel  # late: config validation imports this module

    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=N_POSITIONS,
        n_embd=mcfg.d_model,
        n_layer=mcfg.n_layer,
        n_head=mcfg.n_head,
        n_inner=4 * mcfg.d_model,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOS,
        eos_token_id=EOS,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name:  # ln_1, ln_2, ln_f
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = INIT_STD / math.sqrt(2 * mcfg.n_layer) if name.endswith("c_proj.weight") else INIT_STD
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model


def lm_head_grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the output projection's gradient (the tied embedding matrix in the tiny GPT-2); 0 if none."""
    grad = model.get_output_embeddings().weight.grad
    return 0.0 if grad is None else float(torch.linalg.vector_norm(grad.float()))


def build_model(mcfg: ModelConfig, generator: torch.Generator) -> torch.nn.Module:
    return MODELS[mcfg.name](mcfg, generator)


def float_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as float32 for sampling and log-probs; float64 ones stay float64 (the tests' float64 switch: a model
    moved to float64 computes in float64 throughout; a float32 model is unchanged)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def response_mask(completions: torch.Tensor) -> torch.Tensor:
    """(N, T) completion tokens -> (N, T) bool: tokens up to and including the first EOS (all if none)."""
    is_eos = completions == EOS
    before = is_eos.long().cumsum(-1) - is_eos.long()  # EOS tokens strictly before each position
    return before == 0


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> torch.Tensor:
    """Sample completions with the KV cache.

    Args:
        prompts: (N, P) token ids (fixed length, no padding).
        temperature: softmax temperature (ignored when ``greedy``).
        generator: drives every sample; required unless ``greedy``.
    Returns:
        (N, max_new_tokens) token ids; every position after a sequence's first EOS holds EOS.
    """
    n = prompts.shape[0]
    out = torch.full((n, max_new_tokens), EOS, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    past, inp = None, prompts
    for t in range(max_new_tokens):
        res = model(input_ids=inp, past_key_values=past, use_cache=True)
        past, logits = res.past_key_values, float_logits(res.logits[:, -1])
        if greedy:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = nxt.masked_fill(done, EOS)
        out[:, t] = nxt
        done |= nxt == EOS
        if bool(done.all()):
            break
        inp = nxt[:, None]
    return out


def logprobs(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    completions: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of the completion tokens under ``model`` at ``temperature`` (as OpenRLHF's actor).

    Args:
        prompts: (N, P); completions: (N, T).
    Returns:
        logp (N, T) float32, and the (N, T) entropy of each next-token distribution if ``with_entropy``, else None.
    """
    p = prompts.shape[1]
    seq = torch.cat([prompts, completions[:, :-1]], 1)
    logits = float_logits(model(input_ids=seq, use_cache=False).logits[:, p - 1 :])
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.log_softmax(logits, -1)
    logp = logz.gather(-1, completions[..., None]).squeeze(-1)
    ent = -(logz.exp() * logz).sum(-1) if with_entropy else None
    return logp, ent
