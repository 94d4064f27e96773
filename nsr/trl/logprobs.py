"""Per-token log-probs of completions for ``NSRGRPOTrainer``, computed where they are read (docs/plugins.md, "TRL").

TRL 1.16.0 scores a batch by sending every position through its fused LM head (``add_fused_lm_head``); only on
CUDA / XPU (``trl.kernels``' Triton devices) does it keep just the positions with a label. On CPU every prompt and
padding position is normalised over the vocabulary too: for SmolLM2 at 114 prompt + 32 completion tokens that is 4.6x
the positions whose log-prob is used, and half of a forward+backward. Two exact savings, each a trainer option:

* **compact** (``compact_logprobs``): the backbone runs as TRL runs it (same input ids, attention mask and position
  layout), and only the hidden states that predict a completion token go through the LM head, in TRL's own chunked
  kernel (``trl.kernels.ChunkedLogProbFunction``: tiles of the vocabulary, no (positions, vocabulary) tensor in
  float32). Log-probs and entropies are bit-identical to TRL's (each position's arithmetic is the same); gradients
  agree to float32 rounding (the weight gradient sums fewer zero rows).
* **shared prompt** (``share_prompt``, implies compact): a GRPO batch holds each prompt G times. The prompt is run
  once per distinct prompt (ids and mask) with a key/value cache, the cache is gathered to the rows, and the
  completions run on it at the positions they have in TRL's layout (prompt length + offset), so the attention and
  every later layer see exactly what the full sequence sees. Backward flows through the gathered cache, so each
  prompt's gradient is the sum over its rows, as in the full pass. Log-probs and gradients agree with TRL's to
  float32 rounding (tests/test_trl_fast.py states the tolerance).

Both need a causal LM whose backbone (``base_model``) takes ``past_key_values`` and returns ``last_hidden_state``
(every decoder-only model of transformers 5), a plain LM head (no logit scaling or soft-capping), and no gradient
checkpointing for the shared prompt (the cache is how the prompt reaches the completions). :func:`check_model`
refuses the rest before training.
"""

from __future__ import annotations

import torch

HEAD_CHUNK = 32768
"""Vocabulary columns per tile of the LM head (TRL's ``_CHUNKED_LOGPROB_CHUNK_SIZE``)."""
UNSUPPORTED_SCALING = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                       "logits_scaling")  # fmt: skip
"""Config attributes of models whose logits TRL's head rescales; the compact path refuses them."""


def check_model(model, share_prompt: bool, gradient_checkpointing: bool) -> None:
    """ValueError naming the option if ``model`` cannot take the compact / shared-prompt path."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scaled = [k for k in UNSUPPORTED_SCALING if getattr(config, k, None) not in (None, 1.0)]
    if scaled:
        raise ValueError(
            f"compact_logprobs=True is not valid for {type(model).__name__}: its config rescales the logits "
            f"({', '.join(scaled)}); allowed: compact_logprobs=False (TRL's own head) for such models"
        )
    if model.get_output_embeddings() is None or getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(
            f"compact_logprobs=True is not valid for {type(model).__name__}: it needs a bias-free output layer; "
            "allowed: compact_logprobs=False"
        )
    if share_prompt and gradient_checkpointing:
        raise ValueError(
            "share_prompt=True is not valid with GRPOConfig.gradient_checkpointing=True: the prompt reaches the "
            "completions through its key/value cache, which gradient checkpointing turns off; allowed: "
            "share_prompt=False, or gradient_checkpointing=False"
        )


def _head(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """(log-probs, entropies or None) of ``targets`` (N,) under ``hidden`` (N, H) @ lm_head / temperature, in TRL's
    chunked kernel."""
    from trl.kernels import ChunkedLogProbFunction

    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    weight = model.get_output_embeddings().weight
    hidden = hidden.to(weight.device)
    lp, ent, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, temperature, HEAD_CHUNK, None, 1.0,
                                               outputs)  # fmt: skip
    return lp, ent


def _scatter(values: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """(B, C) with ``values`` at the True positions of ``mask``, zero elsewhere (as TRL's masked_fill)."""
    if values is None:
        return None
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def _compact_rows(model, input_ids, attention_mask, n_completion: int, temperature: float, entropy: bool):
    backbone = model.base_model
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    t = input_ids.shape[1]
    h = hidden[:, t - n_completion - 1 : t - 1]  # position i predicts token i + 1
    mask = attention_mask[:, t - n_completion :].bool()
    lp, ent = _head(model, h[mask], input_ids[:, t - n_completion :][mask], temperature, entropy)
    return _scatter(lp, mask), _scatter(ent, mask)


def _distinct(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the first row of each distinct row, the distinct row of each row) of a (B, L) tensor."""
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    b = rows.shape[0]
    first = torch.full((int(inverse.max()) + 1,), b, dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, inverse, torch.arange(b, device=rows.device), "amin")
    order = torch.argsort(first)  # distinct prompts in order of first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=rows.device)
    return first[order], rank[inverse]


def _shared_rows(model, input_ids, attention_mask, n_completion: int, temperature: float, entropy: bool):
    from transformers import DynamicCache

    backbone = model.base_model
    p = input_ids.shape[1] - n_completion
    prompt_ids, prompt_mask = input_ids[:, :p], attention_mask[:, :p]
    completion_ids = input_ids[:, p:]
    first, row_of = _distinct(torch.cat([prompt_ids, prompt_mask], 1))
    cache = DynamicCache(config=model.config)
    out = backbone(input_ids=prompt_ids[first], attention_mask=prompt_mask[first], past_key_values=cache,
                   use_cache=True)  # fmt: skip
    cache = out.past_key_values
    for layer in cache.layers:  # each row reads its prompt's keys and values (backward sums over the rows)
        layer.keys = layer.keys.index_select(0, row_of)
        layer.values = layer.values.index_select(0, row_of)
    last = out.last_hidden_state[:, -1].index_select(0, row_of)  # predicts the first completion token
    positions = torch.arange(p, p + n_completion, device=input_ids.device).expand(len(input_ids), -1)
    hidden = backbone(input_ids=completion_ids, attention_mask=attention_mask, past_key_values=cache,
                      position_ids=positions, use_cache=True).last_hidden_state  # fmt: skip
    h = torch.cat([last.unsqueeze(1), hidden[:, :-1]], 1)
    mask = attention_mask[:, p:].bool()
    lp, ent = _head(model, h[mask], completion_ids[mask], temperature, entropy)
    return _scatter(lp, mask), _scatter(ent, mask)


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    n_completion: int,
    *,
    temperature: float,
    share_prompt: bool,
    batch_size: int | None = None,
    entropy: bool = False,
    autocast=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies or None), each (B, n_completion), of the last ``n_completion`` tokens of each row of
    ``input_ids`` (prompt then completion, TRL's layout), zero where ``attention_mask`` is 0: what TRL's
    ``_get_per_token_logps_and_entropies`` returns for a text model, in ``batch_size`` rows per forward (None: all),
    each forward inside ``autocast()`` when given (TRL's ``accelerator.autocast``)."""
    from contextlib import nullcontext

    rows = _shared_rows if share_prompt else _compact_rows
    step = batch_size or len(input_ids)
    logps, ents = [], []
    for start in range(0, len(input_ids), step):
        with autocast() if autocast is not None else nullcontext():
            lp, ent = rows(model, input_ids[start : start + step], attention_mask[start : start + step], n_completion,
                           temperature, entropy)  # fmt: skip
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if entropy else None)


def generate_with_shared_prefill(model, generate, input_ids, attention_mask, **kwargs):
    """``generate(input_ids=..., attention_mask=..., **kwargs)`` (transformers' ``GenerationMixin.generate``) with
    each distinct prompt's prefill run once: all but its last token go through the model once with a key/value
    cache at the positions generate gives them (attention-mask cumsum - 1, as ``_prepare_position_ids_for_generation``),
    the cache is gathered to the rows, and generate continues from there. Logits equal generate's own to float32
    rounding (measured on SmolLM2: the same 64 x 32 sampled tokens); a batch without repeated prompts is passed
    through unchanged."""
    from transformers import DynamicCache

    first, row_of = _distinct(torch.cat([input_ids, attention_mask], 1))
    if len(first) == len(input_ids) or input_ids.shape[1] < 2 or kwargs.get("past_key_values") is not None:
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=input_ids[first, :-1], attention_mask=attention_mask[first, :-1],
              position_ids=positions[first, :-1], past_key_values=cache, use_cache=True)  # fmt: skip
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, row_of)
        layer.values = layer.values.index_select(0, row_of)
    return generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)
