"""S tiny GPT-2s of one shape as one model whose weights carry a leading run dimension, with per-run AdamW.

The batched trainer (experiments/tiny/batched.py) trains S runs in one process: every matrix product of the S
models is one ``baddbmm`` over the run dimension, so the per-op overhead that dominates a 0.1M-parameter model on a
CPU is paid once per batch, not once per run. The forward is transformers' GPT-2 (``GPT2LMHeadModel`` as
experiments/models/tiny.py builds it: pre-LN, learned positions, tied embeddings, no dropout, GELU with the tanh
approximation, LayerNorm eps 1e-5, softmax attention scaled by 1 / sqrt(head dim)) written with batched weights, and
generation keeps its own KV cache. Member ``s`` of the batch computes what the HF model with member ``s``'s weights
computes, up to the order in which float sums are taken (tests/test_batched.py: logits and gradients at rtol 1e-5 in
float32).

Storage: the weights of all members live in one ``(S, n)`` buffer (member-major), and each parameter is a leaf view
``(S, *shape)`` of it whose ``.grad`` is a view of one ``(S, n)`` gradient buffer (autograd accumulates into it in
place). So per-run gradient norms, clipping and the whole AdamW update are a handful of ops on ``(S, n)`` tensors,
whatever the number of parameter tensors.

:class:`BatchedAdamW` is ``torch.optim.AdamW`` (its single-tensor CPU path: decoupled weight decay, bias
corrections from the step count, eps added after the square root) with per-run lr, betas and weight decay, a step
count per run and a per-run mask (a gated or inactive run keeps its weights and moments). Member state converts
to and from the single-run formats: an HF state dict and an AdamW ``state_dict``, so a member's checkpoint is a
single run's checkpoint.
"""

from __future__ import annotations

import traceback
import warnings

import torch
import torch.nn.functional as F

from experiments.config import ModelConfig
from experiments.models.tiny import build_model, float_logits
from experiments.tasks.countdown import EOS
from nsr.seeds import generator

LN_EPS = 1e-5  # GPT2Config.layer_norm_epsilon
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, as the single-run trainer uses it
TIED = ("lm_head.weight", "transformer.wte.weight")
"""The output projection is the token embedding (tie_word_embeddings): one parameter, two state-dict entries."""
WTE, WPE = "transformer.wte.weight", "transformer.wpe.weight"

# autograd warns once that a view's gradient does not have the layout of a contiguous parameter; that is the design
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")


def hf_layout(mcfg: ModelConfig) -> tuple[list[str], dict[str, torch.Size], dict[str, torch.Tensor]]:
    """(parameter names in ``named_parameters`` order, their shapes, the state dict's buffers) of the HF model that
    experiments.models.tiny builds for ``mcfg``: the order AdamW's state dict numbers its parameters in."""
    template = build_model(mcfg, generator("batched-layout"))
    names = [n for n, _ in template.named_parameters()]
    shapes = {n: p.shape for n, p in template.named_parameters()}
    buffers = {k: v for k, v in template.state_dict().items() if k not in shapes and k not in TIED}
    return names, shapes, buffers


class BatchedGPT2:
    """S GPT-2s of shape ``mcfg``; member ``s`` starts from ``states[s]`` (an HF ``GPT2LMHeadModel`` state dict)."""

    def __init__(self, mcfg: ModelConfig, states: list[dict], dtype: torch.dtype = torch.float32, device="cpu"):
        if not states:
            raise ValueError("BatchedGPT2 needs at least one member state")
        self.mcfg = mcfg
        self.S = len(states)
        self.n_layer, self.n_head, self.d = mcfg.n_layer, mcfg.n_head, mcfg.d_model
        self.names, self.shapes, self.buffers = hf_layout(mcfg)
        self.offsets: dict[str, tuple[int, int]] = {}
        n = 0
        for name in self.names:
            k = self.shapes[name].numel()
            self.offsets[name] = (n, n + k)
            n += k
        self.n = n
        self.flat = torch.zeros(self.S, n, dtype=dtype, device=device)
        """(S, n) every member's weights, member-major; the parameters are views of it."""
        self.grad = torch.zeros(self.S, n, dtype=dtype, device=device)
        """(S, n) every member's gradient; each parameter's ``.grad`` is a view of it."""
        self.params: dict[str, torch.Tensor] = {}
        for name in self.names:
            a, b = self.offsets[name]
            p = self.flat[:, a:b].view(self.S, *self.shapes[name]).requires_grad_()
            p.grad = self.grad[:, a:b].view(self.S, *self.shapes[name])
            self.params[name] = p
        for s, state in enumerate(states):
            self.load_member(s, state)
        self._member_offsets = torch.arange(self.S, device=device).view(self.S, 1, 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device

    # ---------------------------------------------------------------- member state (the single-run formats)
    def load_member(self, s: int, state: dict) -> None:
        """Copy an HF state dict into member ``s`` (KeyError naming a missing weight)."""
        with torch.no_grad():
            for name in self.names:
                if name not in state:
                    raise KeyError(f"member state has no {name!r}")
                a, b = self.offsets[name]
                self.flat[s, a:b].copy_(state[name].reshape(-1))

    def member_state(self, s: int) -> dict[str, torch.Tensor]:
        """Member ``s`` as an HF ``GPT2LMHeadModel`` state dict (the tied output projection shares the embedding)."""
        out = {}
        for name in self.names:
            a, b = self.offsets[name]
            out[name] = self.flat[s, a:b].detach().to("cpu", copy=True).view(self.shapes[name])
        out.update({k: v.clone() for k, v in self.buffers.items()})
        out[TIED[0]] = out[TIED[1]]
        return {k: out[k] for k in self._state_order(out)}

    def _state_order(self, out: dict) -> list[str]:
        order = [n for n in self.names]
        order += [k for k in self.buffers if k not in order]
        return order + [TIED[0]]

    def subset(self, members: list[int]) -> dict[str, torch.Tensor]:
        """Detached weights of ``members`` (for no-grad work on part of the batch)."""
        idx = torch.tensor(members, device=self.device)
        return {k: v.detach().index_select(0, idx) for k, v in self.params.items()}

    def detached(self) -> dict[str, torch.Tensor]:
        """A detached copy of every member's weights (a frozen reference policy)."""
        return {k: v.detach().clone() for k, v in self.params.items()}

    def zero_grad(self) -> None:
        self.grad.zero_()

    # ---------------------------------------------------------------- the forward
    def forward(self, params, tokens, past=None, pos0: int = 0, first_logit: int = 0, past_index=None, cache=None):
        """Logits of ``tokens`` (S', B, L) at positions pos0 .. pos0 + L - 1 under ``params`` (S' members' weights,
        e.g. :attr:`params`).

        ``past``: per layer, the (keys, values) of positions 0 .. pos0 - 1, each (S' x B', H, pos0, head dim), and
        ``past_index``: the (S' x B,) row of ``past`` each sequence continues (several sequences share one prompt's
        cache), None = row for row. ``cache`` (generation): per layer, preallocated (keys, values) buffers
        (S' x B, H, max length, head dim) holding positions 0 .. pos0 - 1; this call writes its positions into them.
        ``first_logit``: the first of the L positions whose logits are computed. Returns the (S', B, L -
        first_logit, V) logits and the keys and values of positions 0 .. pos0 + L - 1 (row for row).
        """
        S, B, L = tokens.shape
        H, d = self.n_head, self.d
        hd = d // H
        wte = params[WTE]
        V = wte.shape[1]
        idx = tokens + self._member_offsets[:S] * V
        h = F.embedding(idx, wte.reshape(S * V, d)) + params[WPE][:, pos0 : pos0 + L].unsqueeze(1)
        h = h.reshape(S, B * L, d)
        new_past = []
        for i in range(self.n_layer):
            pre = f"transformer.h.{i}."
            a = _layer_norm(h, params[pre + "ln_1.weight"], params[pre + "ln_1.bias"])
            qkv = torch.baddbmm(params[pre + "attn.c_attn.bias"].unsqueeze(1), a, params[pre + "attn.c_attn.weight"])
            q, k, v = qkv.view(S * B, L, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)  # each (S B, H, L, hd)
            n_past = 0
            if cache is not None:
                ck, cv = cache[i]
                ck[:, :, pos0 : pos0 + L] = k
                cv[:, :, pos0 : pos0 + L] = v
                k, v, n_past = ck[:, :, : pos0 + L], cv[:, :, : pos0 + L], pos0
            elif past is not None:
                pk, pv = past[i]
                if past_index is not None:
                    pk, pv = pk.index_select(0, past_index), pv.index_select(0, past_index)
                n_past = pk.shape[2]
                k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            new_past.append((k, v))
            att = _attend(q, k, v, n_past).transpose(1, 2).reshape(S, B * L, d)
            proj = params[pre + "attn.c_proj.weight"]
            h = torch.baddbmm(params[pre + "attn.c_proj.bias"].unsqueeze(1), att, proj) + h
            a = _layer_norm(h, params[pre + "ln_2.weight"], params[pre + "ln_2.bias"])
            m = torch.baddbmm(params[pre + "mlp.c_fc.bias"].unsqueeze(1), a, params[pre + "mlp.c_fc.weight"])
            m = F.gelu(m, approximate="tanh")
            h = torch.baddbmm(params[pre + "mlp.c_proj.bias"].unsqueeze(1), m, params[pre + "mlp.c_proj.weight"]) + h
        if first_logit:
            h = h.view(S, B, L, d)[:, :, first_logit:].reshape(S, -1, d)
        h = _layer_norm(h, params["transformer.ln_f.weight"], params["transformer.ln_f.bias"])
        logits = torch.bmm(h, wte.transpose(1, 2)).view(S, B, L - first_logit, V)
        return logits, new_past

    def logits(self, params, tokens):
        """(S', B, L, V) logits of every position of ``tokens`` (S', B, L), no cache."""
        return self.forward(params, tokens)[0]

    @torch.no_grad()
    def generate(
        self,
        params,
        prompts,
        max_new_tokens: int,
        temperature: float = 1.0,
        generators=None,
        greedy: bool = False,
        group: int = 1,
        errors: dict | None = None,
    ):
        """Sample completions with the KV cache, as experiments.models.tiny.generate does for each member.

        ``prompts`` (S', U, P): each prompt stands for ``group`` consecutive sequences (a rollout's G samples of one
        prompt: ``repeat_interleave``), so the N = U x group sequences share its cache, computed once. Member ``s``
        draws ``torch.multinomial(probs_s, 1, generator=generators[s])`` over its (N, V) probabilities at each new
        token, so its tokens are those of a single run with the same weights and generator. A member whose generator
        is None decodes greedily (an inactive member: no draw). A member stops drawing once all its sequences have
        ended (EOS from there on).

        ``errors``: a dict that gets ``{s: (exception, traceback)}`` of a member whose draw fails (NaN weights: the
        error a single run stops with); that member's tokens are then EOS and the others go on. None: it raises.
        Returns the (S', N, max_new_tokens) tokens."""
        S, U, p = prompts.shape
        N = U * group
        dev = prompts.device
        out = torch.full((S, N, max_new_tokens), EOS, dtype=torch.long, device=dev)
        done = torch.zeros(S, N, dtype=torch.bool, device=dev)
        finished = [False] * S
        logits, past = self.forward(params, prompts, first_logit=p - 1)
        logits = logits[:, :, -1]
        if group > 1:
            logits = logits.repeat_interleave(group, 1)
        cache = []  # each prompt's keys and values, once per sequence, then room for the new tokens
        for k, v in past:
            bufs = []
            for x in (k, v):
                buf = x.new_empty(S * U, group, *x.shape[1:2], p + max_new_tokens, x.shape[-1])
                buf[:, :, :, :p] = x.unsqueeze(1)
                bufs.append(buf.view(S * N, *buf.shape[2:]))
            cache.append(tuple(bufs))
        for t in range(max_new_tokens):
            logits = float_logits(logits)
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1)
                nxt = torch.full((S, N), EOS, dtype=torch.long, device=dev)
                for s in range(S):
                    if finished[s]:
                        continue
                    if generators[s] is None:
                        nxt[s] = logits[s].argmax(-1)
                        continue
                    try:
                        nxt[s] = torch.multinomial(probs[s], 1, generator=generators[s]).squeeze(1)
                    except RuntimeError as e:
                        if errors is None:
                            raise
                        errors.setdefault(s, (e, traceback.format_exc()[-4000:]))
                        done[s] = True
            nxt = nxt.masked_fill(done, EOS)
            out[:, :, t] = nxt
            done |= nxt == EOS
            finished = done.all(1).tolist()
            if all(finished):
                break
            if t + 1 < max_new_tokens:
                logits = self.forward(params, nxt.unsqueeze(-1), pos0=p + t, cache=cache)[0]
                logits = logits[:, :, -1]
        return out

    def logprobs(self, params, prompts, completions, temperature: float = 1.0, with_entropy: bool = False, prefix=None):
        """Per-member experiments.models.tiny.logprobs: (S', B, T) log-probabilities of ``completions`` (S', B, T)
        after their prompts at ``temperature``, and the (S', B, T) entropy if ``with_entropy``.

        ``prompts`` (S', U, P) and ``prefix`` (S', B): sequence b continues prompt ``prefix[:, b]``; each prompt's
        positions are computed once, whatever the number of its sequences (None: U = B, row for row)."""
        S, U, p = prompts.shape
        B, T = completions.shape[1:]
        if prefix is None:
            prefix = torch.arange(B, device=completions.device).expand(S, B)
        rows = (prefix + self._member_offsets[:S, 0] * U).reshape(-1)  # (S B,) rows of the prompts' cache
        last, past = self.forward(params, prompts, first_logit=p - 1)  # (S, U, 1, V): the first token's logits
        logits = last.reshape(S * U, -1).index_select(0, rows).view(S, B, 1, -1)
        if T > 1:
            rest = self.forward(params, completions[..., :-1], past=past, pos0=p, past_index=rows)[0]
            logits = torch.cat([logits, rest], 2)
        logits = float_logits(logits)
        if temperature != 1.0:
            logits = logits / temperature
        logz = torch.log_softmax(logits, -1)
        logp = logz.gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        ent = -(logz.exp() * logz).sum(-1) if with_entropy else None
        return logp, ent


def _attend(q, k, v, n_past: int):
    """Softmax attention of queries at positions n_past .. n_past + L - 1 over keys 0 .. n_past + L - 1, causal."""
    L = q.shape[2]
    if L == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if n_past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    allowed = torch.ones(L, n_past + L, dtype=torch.bool, device=q.device).tril(n_past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _layer_norm(h, weight, bias):
    """LayerNorm over the last dim with a per-member affine (weight, bias: (S, d)); h: (S, M, d)."""
    return torch.addcmul(bias.unsqueeze(1), F.layer_norm(h, h.shape[-1:], eps=LN_EPS), weight.unsqueeze(1))


class MemberView:
    """Member ``s`` of a batched model called like the HF model (``model(input_ids=..., use_cache=False).logits``),
    for code written against one model (experiments.tiny.rewards.self_certainty). No gradient."""

    def __init__(self, model: BatchedGPT2, s: int):
        self.model, self.s = model, s

    class _Out:
        def __init__(self, logits):
            self.logits = logits

    @torch.no_grad()
    def __call__(self, input_ids, use_cache: bool = False, **_):
        params = {k: v.detach()[self.s : self.s + 1] for k, v in self.model.params.items()}
        logits = self.model.logits(params, input_ids.to(self.model.device).unsqueeze(0))[0]
        return self._Out(logits.to(input_ids.device))


class BatchedAdamW:
    """``torch.optim.AdamW`` (CPU single-tensor path) over a :class:`BatchedGPT2`, one set of hyperparameters, one
    step count and one pair of moments per member."""

    def __init__(self, model: BatchedGPT2, lr: list[float], betas: list[tuple], weight_decay: list[float]):
        S = model.S
        if not (len(lr) == len(betas) == len(weight_decay) == S):
            raise ValueError(f"one lr, betas and weight_decay per member ({S}), got {len(lr)}, {len(betas)}, "
                             f"{len(weight_decay)}")  # fmt: skip
        self.model = model
        self.lr, self.betas, self.weight_decay = list(lr), [tuple(b) for b in betas], list(weight_decay)
        self.exp_avg = torch.zeros_like(model.flat)
        self.exp_avg_sq = torch.zeros_like(model.flat)
        self.steps = [0] * S

    def _col(self, values, rows) -> torch.Tensor:
        return torch.tensor([values[s] for s in rows], dtype=self.model.dtype, device=self.model.device).unsqueeze(1)

    @torch.no_grad()
    def step(self, members: list[int]) -> None:
        """One AdamW step of ``members`` (the others keep weights, moments and step count)."""
        if not members:
            return
        every = len(members) == self.model.S
        idx = None if every else torch.tensor(members, device=self.model.device)
        p, g, m, v = (t if every else t.index_select(0, idx) for t in
                      (self.model.flat, self.model.grad, self.exp_avg, self.exp_avg_sq))  # fmt: skip
        for s in members:
            self.steps[s] += 1
        b1 = [self.betas[s][0] for s in members]
        b2 = [self.betas[s][1] for s in members]
        bc1 = [1 - b ** self.steps[s] for b, s in zip(b1, members)]
        bc2 = [1 - b ** self.steps[s] for b, s in zip(b2, members)]
        rows = range(len(members))
        if any(self.weight_decay[s] != 0 for s in members):
            p.mul_(self._col([1 - self.lr[s] * self.weight_decay[s] for s in members], rows))
        m.lerp_(g, self._col([1 - b for b in b1], rows))
        v.mul_(self._col(b2, rows)).addcmul_(g * self._col([1 - b for b in b2], rows), g)
        denom = (v.sqrt() / self._col([c**0.5 for c in bc2], rows)).add_(ADAM_EPS)
        p.addcmul_(m / denom, self._col([-self.lr[s] / c for s, c in zip(members, bc1)], rows))
        if not every:
            for dst, src in ((self.model.flat, p), (self.exp_avg, m), (self.exp_avg_sq, v)):
                dst.index_copy_(0, idx, src)

    # ---------------------------------------------------------------- the single-run format
    def member_state_dict(self, s: int) -> dict:
        """Member ``s``'s state as ``torch.optim.AdamW(hf_model.parameters(), ...).state_dict()`` would give it."""
        model = self.model
        state = {}
        if self.steps[s]:
            for i, name in enumerate(model.names):
                a, b = model.offsets[name]
                shape = model.shapes[name]
                state[i] = {
                    "step": torch.tensor(float(self.steps[s])),
                    "exp_avg": self.exp_avg[s, a:b].to("cpu", copy=True).view(shape),
                    "exp_avg_sq": self.exp_avg_sq[s, a:b].to("cpu", copy=True).view(shape),
                }
        group = {
            "lr": self.lr[s],
            "betas": self.betas[s],
            "eps": ADAM_EPS,
            "weight_decay": self.weight_decay[s],
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "params": list(range(len(model.names))),
        }
        return {"state": state, "param_groups": [group]}

    @torch.no_grad()
    def load_member_state_dict(self, s: int, sd: dict) -> None:
        """Load an AdamW state dict (of the HF model's parameters, as the single-run trainer saves it) into member
        ``s``. ValueError if it is not one (another parameter count, a step count that differs between tensors)."""
        model = self.model
        groups = sd.get("param_groups", [])
        if len(groups) != 1 or len(groups[0].get("params", [])) != len(model.names):
            raise ValueError(f"optimizer state has not one group of {len(model.names)} parameters")
        state = sd.get("state", {})
        if not state:
            self.steps[s] = 0
            self.exp_avg[s].zero_()
            self.exp_avg_sq[s].zero_()
            return
        steps = {int(float(st["step"])) for st in state.values()}
        if len(steps) != 1 or len(state) != len(model.names):
            raise ValueError("optimizer state: every parameter must have one common step count")
        self.steps[s] = steps.pop()
        for i, name in enumerate(model.names):
            a, b = model.offsets[name]
            self.exp_avg[s, a:b].copy_(state[i]["exp_avg"].reshape(-1))
            self.exp_avg_sq[s, a:b].copy_(state[i]["exp_avg_sq"].reshape(-1))


def clip_grad_norms(model: BatchedGPT2, max_norm: list[float]) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` per member: each member's gradient scaled to at most ``max_norm[s]``
    (norm 2 over all its parameters; coefficient max_norm / (norm + 1e-6), at most 1). Returns the (S,) norms
    before clipping."""
    norms = torch.linalg.vector_norm(model.grad, dim=1)
    limit = torch.tensor(max_norm, dtype=model.dtype, device=model.device)
    coef = (limit / (norms + 1e-6)).clamp(max=1.0)
    model.grad.mul_(coef.unsqueeze(1))
    return norms
