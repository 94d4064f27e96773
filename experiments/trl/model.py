"""The tiny Qwen2 policy of the trl backend, its character tokenizer, the Countdown-3 dataset and reward for TRL.

``tiny-qwen2`` is a transformers ``Qwen2ForCausalLM`` at toy size built in code (no hub), on the tiny testbed's
16-token vocabulary (experiments/tiny/task.py), so the testbed's SFT warm start (experiments/tiny/sft.py, cached by
the hash of the model and sft sections and the task name) trains it unchanged: importing this module registers the
builder in the testbed's model registry. The tokenizer maps each character to the testbed's token id and EOS to 15
(also the pad token), so TRL's prompts, completions and masks are the testbed's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from experiments.tiny.model import INIT_STD, MODELS
from experiments.tiny.task import CHARS, EOS, N_POSITIONS, VOCAB_SIZE, Task, decode

if TYPE_CHECKING:  # annotations only: config validation imports this module
    from experiments.config import ModelConfig

EOS_TEXT = "<eos>"


@MODELS.register("tiny-qwen2")
def tiny_qwen2(mcfg: ModelConfig, generator: torch.Generator) -> torch.nn.Module:
    """A Qwen2 (RMSNorm, RoPE, SwiGLU, grouped KV heads, tied embeddings) initialised from ``generator``:
    weights normal(0, 0.02), output projections scaled by 1/sqrt(2 n_layer) as in GPT-2, norms 1, biases 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # late: config validation imports this module

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=mcfg.d_model,
        intermediate_size=4 * mcfg.d_model,
        num_hidden_layers=mcfg.n_layer,
        num_attention_heads=mcfg.n_head,
        num_key_value_heads=max(1, mcfg.n_head // 2),
        max_position_embeddings=N_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
        attention_dropout=0.0,
        use_cache=True,
    )
    config._attn_implementation = "sdpa"
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
    model.generation_config.pad_token_id = EOS
    model.generation_config.eos_token_id = EOS
    return model


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


def train_dataset(task: Task):
    """The task's training split as a datasets.Dataset with columns prompt (text) and problem_id."""
    from datasets import Dataset

    ids = task.train_ids.tolist()
    return Dataset.from_dict({"prompt": [task.prompt_text(i) for i in ids], "problem_id": ids})


def task_reward(task: Task):
    """TRL reward function: 1.0 if the completion (tokens up to its EOS) solves the problem, else 0.0 (the
    testbed's exact verifier on the same token ids)."""

    def reward(prompts, completions, completion_ids, problem_id, **kwargs) -> list[float]:
        return [float(task.is_correct(int(p), decode(ids))) for p, ids in zip(problem_id, completion_ids)]

    reward.__name__ = f"{task.name}_correct"
    return reward
