"""Tiny Hugging Face models, tokenizer and datasets built in code (no hub) for the TRL tests: a dense causal LM
(Qwen2), a mixture-of-experts causal LM (Qwen3-MoE, with a router load-balancing loss), a sequence-classification
reward model (Qwen2), a character tokenizer with a chat template, and the "zen" prompts (TRL's test dataset is the
Zen of Python; here read from the standard library's ``this`` module)."""

from __future__ import annotations

import codecs
import contextlib
import gc
import string
from functools import lru_cache

import torch

EOS = "<|endoftext|>"
CHARS = string.printable
"""The tokenizer's vocabulary: one token per printable ASCII character, then the EOS / pad token."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer():
    """A ``PreTrainedTokenizerFast``: one token per printable character, ``<|endoftext|>`` as EOS and pad (id 100),
    a minimal chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)} | {EOS: len(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=EOS)
    out.chat_template = CHAT_TEMPLATE
    return out


VOCAB = len(CHARS) + 1


def _common(seed: int) -> dict:
    torch.manual_seed(seed)
    return dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1,
    )  # fmt: skip


def dense_lm(seed: int = 0):
    """A Qwen2ForCausalLM with two layers of width 16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_common(seed), intermediate_size=32))


def moe_lm(seed: int = 0):
    """A Qwen3MoeForCausalLM with two sparse layers of 4 experts (2 per token); its config's router_aux_loss_coef
    (0.001) makes TRL add the load-balancing loss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **_common(seed), head_dim=8, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def reward_model(seed: int = 1):
    """A Qwen2ForSequenceClassification (one label) on the same tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    return Qwen2ForSequenceClassification(Qwen2Config(**_common(seed), intermediate_size=32, num_labels=1))


@lru_cache
def zen_lines() -> tuple[str, ...]:
    import this  # prints the Zen of Python on first import; its text is this.s, rot13

    text = codecs.decode(this.s, "rot13")
    return tuple(line for line in text.splitlines()[2:] if line.strip())


def zen(config: str = "standard_prompt_only", n_train: int = 6, n_test: int = 3):
    """A DatasetDict(train, test) of prompts: the first half of each line of the Zen of Python (TRL's "zen" test
    dataset, rebuilt locally). ``config``: standard_prompt_only (text) or conversational_prompt_only (messages)."""
    from datasets import Dataset, DatasetDict

    prompts = [" ".join(line.split()[: (len(line.split()) + 1) // 2]) for line in zen_lines()]
    if config == "conversational_prompt_only":
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    elif config != "standard_prompt_only":
        raise ValueError(f"config={config!r} is not valid; allowed: standard_prompt_only, conversational_prompt_only")
    return DatasetDict(
        train=Dataset.from_dict({"prompt": prompts[:n_train]}),
        test=Dataset.from_dict({"prompt": prompts[n_train : n_train + n_test]}),
    )


def save_models(folder) -> dict[str, str]:
    """Save the dense and MoE policies and the reward model, each with the tokenizer, under ``folder``; returns
    {"dense": path, "moe": path, "reward": path}."""
    from pathlib import Path

    paths = {}
    for name, build in (("dense", dense_lm), ("moe", moe_lm), ("reward", reward_model)):
        path = Path(folder) / name
        build().save_pretrained(path)
        char_tokenizer().save_pretrained(path)
        paths[name] = str(path)
    return paths


@contextlib.contextmanager
def one_thread_frozen_gc():
    """For a module of tiny-model TRL runs: one torch thread (two threads cost more than they give at width 16, and
    far more on a loaded 2-core box) and the objects alive now frozen out of the garbage collector (accelerate calls
    gc.collect() after every train(), which otherwise walks torch's and transformers' objects each time); both
    restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
