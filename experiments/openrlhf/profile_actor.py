"""Where the OpenRLHF actor's share of a CPU run's RL step goes: one DeepSpeed rank in this process, no Ray, no vLLM.

    python -m experiments.openrlhf.profile_actor sweeps/presets/smollm2-openrlhf-cpu.yaml train.minibatches=16
    python -m experiments.openrlhf.profile_actor PRESET train.minibatches=2 --rollouts 2 --json out.jsonl
    python -m experiments.openrlhf.profile_actor PRESET train.minibatches=16 --full-logits --loop-adam   # before

It builds the policy rank the way a CPU run's Ray actor does (the CPU shim's patches, the launcher's settings and
strategy, ``NSRPolicyModelActor.init_model_from_pretrained``: OpenRLHF's Actor, DeepSpeed engine and NSRPolicyLoss,
with the run's argv from experiments/openrlhf/argv.py), then per rollout: the old-log-prob pass over the rollout
(``PolicyModelActor.forward`` per micro-batch of ``openrlhf.micro_rollout_batch_size``), the advantages, and
``fit`` (every optimizer update). The rollout is the task's own prompts (the preset's chat template, tokenised by the
model's tokenizer) with ``prompts_per_step x samples_per_prompt`` responses: the one-shot's worked answer for each
problem (about 25 tokens), and seeded 0/1 rewards. Generation, rewards and the weight sync are not here: a run's own
``timing/*`` (metrics.jsonl ``generation_s``, ``wall_s``) has them.

Per rollout it prints one JSON line: seconds in the old-log-prob pass and in ``fit``, and within ``fit`` the sum
over the updates of forward (the model and the log-probs), backward (DeepSpeed's, its gradient hooks included) and
the optimizer step (DeepSpeed's ``step``: gradient clipping, Adam, the copies to the model's dtype); inside forward
and backward, the time in the attention blocks, the MLP blocks, the LM head, and the log-softmax over the
vocabulary (forward: OpenRLHF's ``log_probs_from_logits``; backward: from the start of the backward to the LM head's
backward); the process's peak RSS; and its compute threads (``threads``: what the run's launcher gives a rank,
experiments/openrlhf/argv.py ``cpu_threads``: ``NSR_THREADS``, default 1, or ``OMP_NUM_THREADS`` if set). The times
are wall-clock and the hooks time each part on its own; on a shared machine compare runs made side by side, not single
numbers.

``--full-logits`` leaves out the compact log-probs (nsr/openrlhf/logprobs.py: OpenRLHF's forward over every
position) and ``--loop-adam`` the fused AdamW (the shim's ADAM_PARAMS: torch's per-tensor loop), to measure each
saving against what was there before. Loads the model (SmolLM2: about 3 GB RSS with its Adam states).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
from collections import defaultdict

PARTS = ("attention", "mlp", "lm_head")
"""Modules timed by hooks: every decoder layer's ``self_attn`` and ``mlp``, and the LM head."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Clock:
    """Wall seconds per part, from forward and backward hooks on the model's modules (the parts run one after
    another: they never overlap)."""

    def __init__(self, model):
        self.sec = defaultdict(float)
        self.head_backward_at = None
        named = dict(model.named_modules())
        for name, module in named.items():
            if name.endswith(".self_attn"):
                self._hook(module, "attention", backward=False)  # called with keywords: no full backward hook
                self._attention_backward(module)
            elif name.endswith(".mlp"):
                self._hook(module, "mlp")
        self._hook(model.get_output_embeddings(), "lm_head")

    def _attention_backward(self, attention):
        """An attention block's backward: from its output projection's backward to its query projection's, the last
        of its input projections in backward order."""
        start = {}

        def begin(mod, grad_out):
            start["b"] = time.perf_counter()

        def end(mod, grad_in, grad_out):
            if "b" in start:
                self.sec["backward_attention"] += time.perf_counter() - start.pop("b")

        attention.o_proj.register_full_backward_pre_hook(begin)
        attention.q_proj.register_full_backward_hook(end)

    def _hook(self, module, part, backward: bool = True):
        start = {}

        def pre(mod, args):
            start["f"] = time.perf_counter()

        def post(mod, args, out):
            self.sec[f"forward_{part}"] += time.perf_counter() - start.pop("f")

        def bpre(mod, grad_out):
            if part == "lm_head" and self.head_backward_at is None:
                self.head_backward_at = time.perf_counter()
            start["b"] = time.perf_counter()

        def bpost(mod, grad_in, grad_out):
            self.sec[f"backward_{part}"] += time.perf_counter() - start.pop("b")

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        if backward:
            module.register_full_backward_pre_hook(bpre)
            module.register_full_backward_hook(bpost)


def build(preset: str, overrides: list[str], full_logits: bool, loop_adam: bool):
    """(cfg, actor, strategy, args): the policy rank of a CPU run, built in this process."""
    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from experiments.config import load_config
    from experiments.openrlhf.argv import build_command, cpu_threads
    from nsr.openrlhf import cpu_shim

    cfg = load_config(preset, overrides)
    if not cfg.openrlhf.cpu:
        raise SystemExit(f"{preset}: openrlhf.cpu is false; this profiles a CPU run's actor")
    threads = os.environ.get("OMP_NUM_THREADS") or str(cpu_threads(cfg))  # as the run's launcher sets it
    os.environ.update(cpu_shim.cpu_env(), OMP_NUM_THREADS=threads)
    import torch

    torch.set_num_threads(int(threads))
    cpu_shim.stand_in_flash_attn()
    cpu_shim.patch_torch_cuda()
    cpu_shim.patch_replay_buffer()
    cpu_shim.patch_fp32()
    if loop_adam:
        cpu_shim.ADAM_PARAMS = {"torch_adam": True}
    cpu_shim.patch_deepspeed()
    if not full_logits:
        from nsr.openrlhf import logprobs

        logprobs.install()
    import openrlhf.utils

    from nsr.openrlhf import actors, launch
    from nsr.openrlhf.cli import parse
    from nsr.openrlhf.settings import NSRSettings

    cmd = build_command(cfg, "/tmp/nsr-profile-actor", "profile")
    settings, rest = NSRSettings.parse(cmd.argv[3:])
    args = parse(rest)
    launch.install(settings)
    strategy = openrlhf.utils.get_strategy(args)
    torch.cuda.current_device = lambda: 0  # the replay buffer formats cuda:<i> while the trainer is built
    actor = actors.NSRPolicyModelActor(1, 0, "127.0.0.1", port)
    actor.init_model_from_pretrained(strategy, args.actor.model_name_or_path, max_steps=1000, vllm_engines=None)
    actor.trainer.replay_buffer.target_device = torch.device("cpu")
    torch.cuda.current_device = lambda: "cpu"
    return cfg, actor, strategy, args


def rollout(cfg, tokenizer, seed: int):
    """``prompts_per_step x samples_per_prompt`` Experiences of the task's prompts and worked answers (module doc)."""
    import torch

    from experiments.openrlhf import handmade
    from experiments.tasks.arithmetic import split

    g = torch.Generator().manual_seed(seed)
    rows = split(cfg.task)["train"]
    out = []
    for p in range(cfg.rollout.prompts_per_step):
        row = rows[(seed * cfg.rollout.prompts_per_step + p) % len(rows)]
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        a, b, c = (int(x) for x in row["problem"].replace("*", " ").replace("+", " ").split())
        answer = f"{a} * {b} = {a * b}, and {a * b} + {c} = {row['label']}. The answer is \\boxed{{{row['label']}}}."
        response = tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        response = torch.cat([response, torch.tensor([tokenizer.eos_token_id])])[: cfg.rollout.max_new_tokens]
        seq = torch.cat([prompt, response])
        for _ in range(cfg.rollout.samples_per_prompt):
            reward = float(torch.rand((), generator=g) < 0.5)
            out.append(handmade.sample(seq, len(prompt), f"p{p}", row["label"], reward))
    return out


def profile(cfg, actor, strategy, args, rollouts: int) -> list[dict]:
    import torch
    from openrlhf.models import utils as model_utils

    from experiments.openrlhf import handmade

    engine = actor.actor.model
    clock = Clock(engine.module)
    sec = clock.sec

    def timed(obj, name, key):
        f = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                sec[key] += time.perf_counter() - t

        setattr(obj, name, wrapper)
        return wrapper

    timed(engine, "step", "optimizer_step")
    backward = engine.backward

    def engine_backward(loss, *a, **k):
        clock.head_backward_at = None
        t = time.perf_counter()
        try:
            return backward(loss, *a, **k)
        finally:
            sec["backward"] += time.perf_counter() - t
            if clock.head_backward_at is not None:
                sec["backward_log_softmax"] += clock.head_backward_at - t

    engine.backward = engine_backward
    logsoftmax = model_utils.log_probs_from_logits
    import openrlhf.models.actor as actor_module

    def log_probs_from_logits(*a, **k):
        t = time.perf_counter()
        try:
            return logsoftmax(*a, **k)
        finally:
            sec["forward_log_softmax"] += time.perf_counter() - t

    model_utils.log_probs_from_logits = actor_module.log_probs_from_logits = log_probs_from_logits

    maker = handmade.experience_maker(strategy, args, actor.tokenizer)
    out = []
    for i in range(rollouts):
        sec.clear()
        micro = maker.split_rollout_samples(rollout(cfg, actor.tokenizer, seed=i))
        t = time.perf_counter()
        for e in micro:
            e.action_log_probs = actor.forward(e.sequences, e.action_mask, e.attention_mask)
            e.base_action_log_probs, e.values = None, None
            e.kl = torch.zeros_like(e.action_log_probs)
            e.info["kl"] = torch.zeros(len(e.sequences))
        old = time.perf_counter() - t
        before = dict(sec)
        sec.clear()
        for e in maker.compute_advantages_and_returns(micro):
            actor.append(e)
        t = time.perf_counter()
        actor.fit(0.0)
        fit = time.perf_counter() - t
        updates = round(cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt / cfg.openrlhf.train_batch_size)
        row = {
            "rollout": i + 1,
            "updates": updates * cfg.train.epochs,
            "old_logprobs_s": old,
            "old_logprobs_lm_head_s": before.get("forward_lm_head", 0.0),
            "old_logprobs_log_softmax_s": before.get("forward_log_softmax", 0.0),
            "fit_s": fit,
            "optimizer_step_s": sec["optimizer_step"],
            "backward_s": sec["backward"],
            "forward_and_rest_s": fit - sec["optimizer_step"] - sec["backward"],
            **{f"{k}_s": v for k, v in sorted(sec.items()) if k.startswith(("forward_", "backward_"))},
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
        out.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.openrlhf.profile_actor", description=__doc__.split("\n")[0])
    p.add_argument("preset")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--rollouts", type=int, default=2, help="rollouts to profile (the first also warms up)")
    p.add_argument("--full-logits", action="store_true", help="OpenRLHF's forward over every position")
    p.add_argument("--loop-adam", action="store_true", help="torch's per-tensor AdamW loop (DeepSpeed's default)")
    p.add_argument("--json", default="", help="append the rows to this file")
    a = p.parse_intermixed_args(argv)
    cfg, actor, strategy, args = build(a.preset, a.overrides, a.full_logits, a.loop_adam)
    for row in profile(cfg, actor, strategy, args, a.rollouts):
        row |= {"full_logits": a.full_logits, "loop_adam": a.loop_adam, "overrides": a.overrides}
        row["threads"] = int(os.environ["OMP_NUM_THREADS"])
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
