"""Where a trl-backend RL step's seconds and memory go: ``python -m experiments.trl.bench ... --profile``.

A :class:`StepProfile` attached to a (kit's or TRL's own) GRPOTrainer splits each RL step into phases and, inside
each, the model's parts, by wall time (CPU work is synchronous, so a part's seconds are its own):

* phases: ``generation`` (transformers' generate), ``old_logprobs`` (the rollout's old-log-prob pass: TRL's inside
  the scoring, or the kit's after the split), ``forward`` and ``backward`` of every update (the loss's forward, then
  ``accelerator.backward``), ``optimizer`` (the optimizer step, between the Trainer's pre- and post-step callbacks;
  gradient clipping comes before it and is in ``other``), and ``other`` (the rest of the step: rewards,
  advantages, shuffling, clipping, logging);
* parts, within each phase: ``attention`` and ``mlp`` (every decoder layer's ``self_attn`` and ``mlp`` modules: forward
  by forward hooks; backward by full backward hooks on the MLP and on the whole layer, the attention's backward being
  the layer's less the MLP's, so it includes the layer's norms and residual adds), ``lm_head`` (TRL's chunked
  log-prob head, ``trl.kernels.ChunkedLogProbFunction``, forward and backward, where both trainers normalise over the
  vocabulary for their log-probs; generation's own head is the module ``lm_head`` and counts there too);
* memory: the process's resident set, sampled every 20 ms, its maximum within each phase.

Hooks cost a few microseconds per module call: the totals are slightly above an unprofiled step's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict

PHASES = ("generation", "old_logprobs", "forward", "backward", "optimizer", "other")
PARTS = ("attention", "mlp", "lm_head")


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepProfile:
    """Phase and part seconds of each RL step of ``trainer`` (k optimizer steps each), and peak RSS per phase."""

    def __init__(self, trainer, k: int):
        from transformers import TrainerCallback

        self.trainer, self.k = trainer, k
        self.steps: list[dict] = []
        self._phase = ["other"]
        self._cur: dict = {}
        self._t_step = None
        self._stop = threading.Event()
        self._hooks = []
        self._restore = []
        self._wrap_methods()
        self._hook_modules(trainer.model)
        self._wrap_head()
        profile = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step % profile.k == 0:
                    profile._begin_step()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                profile._push("optimizer")

            def on_optimizer_step(self, args, state, control, **kw):
                profile._pop("optimizer")

            def on_step_end(self, args, state, control, **kw):
                if state.global_step % profile.k == 0:
                    profile._end_step()

        trainer.add_callback(Clock())
        threading.Thread(target=self._sample_memory, daemon=True).start()

    # ---------------------------------------------------------------- phases
    def _begin_step(self):
        self._cur = {"seconds": defaultdict(float), "parts": defaultdict(float), "peak_rss": defaultdict(int),
                     "since": {}}  # fmt: skip
        self._t_step = time.perf_counter()

    def _end_step(self):
        if self._t_step is None:
            return
        total = time.perf_counter() - self._t_step
        sec = self._cur["seconds"]
        sec["other"] = total - sum(v for k, v in sec.items() if k != "other")
        self.steps.append({
            "total": total,
            "seconds": dict(sec),
            "parts": dict(self._cur["parts"]),
            "peak_rss_gb": {k: v / 2**30 for k, v in self._cur["peak_rss"].items()},
        })  # fmt: skip
        self._t_step = None

    def _push(self, phase: str):
        self._phase.append(phase)
        if self._t_step is not None:
            self._cur["since"][phase] = time.perf_counter()

    def _pop(self, phase: str):
        if self._phase[-1] == phase:
            self._phase.pop()
        if self._t_step is not None and phase in self._cur["since"]:
            self._cur["seconds"][phase] += time.perf_counter() - self._cur["since"].pop(phase)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Count what runs inside as phase ``name`` (the outermost phase wins: a forward inside the old-log-prob
        pass is the pass's)."""
        if self._phase[-1] != "other":
            yield
            return
        self._push(name)
        try:
            yield
        finally:
            self._pop(name)

    def _wrap(self, obj, name: str, phase: str):
        original = getattr(obj, name)

        def wrapped(*a, **kw):
            with self.phase(phase):
                return original(*a, **kw)

        setattr(obj, name, wrapped)
        self._restore.append((obj, name))

    def _wrap_methods(self):
        t = self.trainer
        self._wrap(t, "_generate", "generation")
        if hasattr(t, "_old_logps_of"):  # the kit: the old pass runs after the split
            self._wrap(t, "_old_logps_of", "old_logprobs")
        original = t._get_per_token_logps_and_entropies  # TRL's old pass: without a gradient, inside the scoring

        def logps(*a, **kw):
            import torch

            name = "old_logprobs" if not torch.is_grad_enabled() else "forward"
            with self.phase(name):
                return original(*a, **kw)

        t._get_per_token_logps_and_entropies = logps
        self._restore.append((t, "_get_per_token_logps_and_entropies"))
        self._wrap(t, "compute_loss", "forward")
        self._wrap(t.accelerator, "backward", "backward")

    # ---------------------------------------------------------------- parts
    def _add_part(self, part: str, seconds: float):
        if self._t_step is not None:
            self._cur["parts"][f"{self._phase[-1]}/{part}"] += seconds

    def _hook_modules(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = getattr(base.base_model, "layers", None) or getattr(base.base_model, "h", [])
        for layer in layers:  # attention is called with keyword arguments, which full backward hooks do not see:
            # its backward is the layer's minus the MLP's (summary)
            self._timed_module(layer, "layer", forward=False)
            attention = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
            if attention is not None:
                self._timed_module(attention, "attention", backward=False)
            if getattr(layer, "mlp", None) is not None:
                self._timed_module(layer.mlp, "mlp")
        head = base.get_output_embeddings()
        if head is not None:
            self._timed_module(head, "lm_head", backward=False)

    def _timed_module(self, module, part: str, forward: bool = True, backward: bool = True):
        starts = []

        def pre(m, args):
            starts.append(time.perf_counter())

        def post(m, args, out):
            self._add_part(part, time.perf_counter() - starts.pop())

        if forward:
            self._hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        if backward:
            bstarts = []

            def bpre(m, grad_out):
                bstarts.append(time.perf_counter())

            def bpost(m, grad_in, grad_out):
                if bstarts:
                    self._add_part(part, time.perf_counter() - bstarts.pop())

            self._hooks += [module.register_full_backward_pre_hook(bpre), module.register_full_backward_hook(bpost)]

    def _wrap_head(self):
        from trl.kernels import ChunkedLogProbFunction as F

        profile = self
        fwd, bwd = F.forward, F.backward

        def forward(ctx, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fwd(ctx, *a, **kw)
            finally:
                profile._add_part("lm_head", time.perf_counter() - t0)

        def backward(ctx, *a):
            t0 = time.perf_counter()
            try:
                return bwd(ctx, *a)
            finally:
                profile._add_part("lm_head", time.perf_counter() - t0)

        F.forward, F.backward = staticmethod(forward), staticmethod(backward)
        self._head = (F, fwd, bwd)

    def _sample_memory(self):
        while not self._stop.wait(0.02):
            if self._t_step is not None:
                peak = self._cur["peak_rss"]
                phase = self._phase[-1]
                peak[phase] = max(peak[phase], _rss_bytes())

    def close(self):
        self._stop.set()
        for h in self._hooks:
            h.remove()
        for obj, name in self._restore:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        F, fwd, bwd = self._head
        F.forward, F.backward = staticmethod(fwd), staticmethod(bwd)

    def summary(self, skip_first: bool = True) -> dict:
        """Medians over the steps (the first left out: start-up), rounded: {"seconds": {phase}, "parts":
        {phase/part}, "peak_rss_gb": {phase}, "steps": n}."""
        import statistics

        steps = self.steps[1:] if skip_first and len(self.steps) > 1 else self.steps

        for s in steps:  # a layer's backward less its MLP's: attention with the layer's norms and residual adds
            parts = s["parts"]
            for name in [n for n in parts if n.endswith("/layer")]:
                phase = name.split("/")[0]
                parts[f"{phase}/attention"] = parts.pop(name) - parts.get(f"{phase}/mlp", 0.0)

        def med(key):
            names = sorted({n for s in steps for n in s[key]})
            return {n: round(statistics.median(s[key].get(n, 0.0) for s in steps), 2) for n in names}

        return {"steps": len(steps), "total_s": round(statistics.median(s["total"] for s in steps), 2),
                "seconds": med("seconds"), "parts": med("parts"), "peak_rss_gb": med("peak_rss_gb")}  # fmt: skip
