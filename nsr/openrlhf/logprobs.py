"""The OpenRLHF actor's log-probs from the positions that predict a response token only (a CPU run's actor).

OpenRLHF 0.11.2's ``Actor.forward`` (models/actor.py) sends every position of every sequence through the LM head,
casts the whole (batch, length, vocabulary) logits to float32 (49152 columns for SmolLM2: 0.4 GB per micro-batch of
16 sequences of 130 tokens), takes log-softmax over it and then keeps the last ``action_mask.shape[1]`` columns,
zeroed where the action mask is 0. In 0.11.2 each sample is its prompt then its response, right-padded
(``Experience.concat_experiences``), and its action mask spans the whole sequence (zeros over the prompt), so the
prompt positions' log-probs are computed and multiplied by 0. :func:`compact_forward` asks the model for the logits
of the positions from the first one that predicts a response token in any row of the micro-batch (transformers'
``logits_to_keep``, an index tensor) and gives them to OpenRLHF's own ``log_probs_from_logits``: the same
transformer body, the same LM head rows, the same float32 cast, temperature and log-softmax; the columns before are
zeros, as OpenRLHF's mask makes them. With prompts of one length (the arithmetic task's chat prompts: 98-101 tokens)
that is the response columns alone; with prompts of very different lengths, the shortest prompt sets the start.

Used for every forward that returns action log-probs without the extras it does not cover: the old-log-prob pass
(``PolicyModelActor.forward``) and each training micro-batch (``ActorPPOTrainer.training_step``, which also reads
``output.aux_loss`` of a mixture-of-experts model: the output it gets is the model's own, its ``logits`` the kept
positions'). Everything else goes to OpenRLHF's forward unchanged: packed samples, ring attention, a vision-language
model or multimodal inputs, an entropy request (``--actor.entropy_coef``), a call without an action mask, and a model
whose forward has no ``logits_to_keep``. tests/test_openrlhf_logprobs.py checks the log-probs and their gradients
against OpenRLHF's forward.

Installed by the CPU shim only (nsr/openrlhf/cpu_shim.py ``setup_worker``): a cluster run keeps OpenRLHF's forward.
"""

from __future__ import annotations

import inspect

_ORIGINAL = "_nsr_full_forward"


def keeps_logits(model) -> bool:
    """Whether ``model`` (an HF causal LM, or a DeepSpeed engine around one) takes ``logits_to_keep``."""
    module = getattr(model, "module", model)
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


KWARGS = {"return_output", "ring_attn_group", "packed_seq_lens", "return_entropy", "return_logprobs"}
KWARGS |= {"allgather_logits"}
"""The keyword arguments of ``Actor.forward`` a covered call may carry (anything else, multimodal inputs included,
goes to OpenRLHF's forward)."""


def covered(actor, action_mask, kwargs: dict) -> bool:
    """Whether :func:`compact_forward` computes this call of ``Actor.forward`` (module doc)."""
    return (
        action_mask is not None
        and set(kwargs) <= KWARGS
        and not actor.packing_samples
        and not getattr(actor, "is_vlm", False)
        and kwargs.get("ring_attn_group") is None
        and kwargs.get("packed_seq_lens") is None
        and not kwargs.get("return_entropy", False)
        and not kwargs.get("return_logprobs", False)
        and not kwargs.get("allgather_logits", False)
        and keeps_logits(actor.model)
    )


def first_action(action_mask) -> int:
    """The first column of ``action_mask`` (B, A) that holds a response token in any row (A - 1 if none does)."""
    import torch

    columns = torch.nonzero(action_mask.any(0))
    return int(columns[0]) if len(columns) else action_mask.shape[1] - 1


def compact_forward(actor, sequences, action_mask, attention_mask, return_output: bool = False):
    """``Actor.forward(sequences, action_mask, attention_mask, return_output=...)`` with the LM head on the positions
    from the first that predicts a response token on: the same action log-probs (and, with ``return_output``, the
    model's output, ``logits`` the kept positions' in float32)."""
    import torch
    from openrlhf.models.utils import log_probs_from_logits

    length, actions = sequences.shape[1], action_mask.shape[1]
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    # column j of the (B, length - 1) log-probs is token j + 1 given positions 0..j; the action mask covers the last
    # ``actions`` columns, and the columns before its first response token are zeros
    skip = first_action(action_mask)
    start = length - 1 - actions + skip
    keep = torch.arange(start, length - 1, device=sequences.device)
    output = actor.model(sequences, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep)
    output["logits"] = output["logits"].to(torch.float32)
    if actor.temperature != 1.0:  # out of place: in float32 ``.to`` returns the model's own output, which a module
        output["logits"] = output["logits"] / actor.temperature  # hook (the profiler's) makes an unwritable view
    log_probs = log_probs_from_logits(output["logits"], sequences[:, start + 1 :])
    if skip:
        log_probs = torch.cat([log_probs.new_zeros(len(log_probs), skip), log_probs], dim=1)
    action_log_probs = log_probs * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs


def install() -> None:
    """Route OpenRLHF's ``Actor.forward`` through :func:`compact_forward` for the calls it covers (once per
    process)."""
    from openrlhf.models.actor import Actor

    if hasattr(Actor, _ORIGINAL):
        return
    full = Actor.forward

    def forward(self, sequences, action_mask=None, attention_mask=None, *args, **kwargs):
        if not args and covered(self, action_mask, kwargs):
            return compact_forward(self, sequences, action_mask, attention_mask, kwargs.get("return_output", False))
        return full(self, sequences, action_mask, attention_mask, *args, **kwargs)

    setattr(Actor, _ORIGINAL, full)
    Actor.forward = forward
