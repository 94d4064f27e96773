"""Evaluation sampling for HF models on the trl backend (math benchmarks): greedy and eval.n_samples samples per
prompt with transformers' generate, seeded from (eval.seed, step) in a forked RNG (training draws are untouched)."""

from __future__ import annotations

import torch

from nsr.seeds import derive_seed

EVAL_BATCH = 16
"""Prompts per generate call."""


@torch.no_grad()
def sample_texts(model, tok, prompts: list, cfg, step: int) -> dict[str, list[list[str]]]:
    """{decoding: completions[i][k]} for decoding greedy (one each, if eval.greedy) and sampled (eval.n_samples)."""
    e = cfg.eval
    if prompts and isinstance(prompts[0], list):  # chat messages
        prompts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    was_training = model.training
    model.eval()
    out: dict[str, list[list[str]]] = {}
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(e.seed, step, "trl-eval"))
        for decoding, n, kw in (("greedy", 1 if e.greedy else 0, {"do_sample": False}),
                                ("sampled", e.n_samples, {"do_sample": True, "temperature": e.temperature, "top_p": 1.0,
                                                          "top_k": 0})):  # fmt: skip
            if n == 0:
                continue
            texts = []
            for i in range(0, len(prompts), EVAL_BATCH):
                enc = tok(prompts[i : i + EVAL_BATCH], return_tensors="pt", padding=True, padding_side="left",
                          add_special_tokens=False).to(model.device)  # fmt: skip
                ids = model.generate(**enc, max_new_tokens=cfg.rollout.max_new_tokens, num_return_sequences=n, **kw)
                texts += tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            out[decoding] = [texts[j * n : (j + 1) * n] for j in range(len(prompts))]
    model.train(was_training)
    return out
