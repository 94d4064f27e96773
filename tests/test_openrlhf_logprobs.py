"""The CPU run's compact actor log-probs (nsr/openrlhf/logprobs.py) against OpenRLHF 0.11.2's own ``Actor.forward``,
on OpenRLHF's real Actor around a random tiny Qwen2 (tests/fixtures/openrlhf/real_step.py), in bf16 and in float32:
the same log-probs bit for bit, the same gradients (rtol 1e-6, atol 1e-7: float32 rounding; measured equal), and the
LM head run on the response positions only; the calls it does not cover reach OpenRLHF's forward unchanged."""

import pytest

pytest.importorskip("openrlhf", reason="openrlhf==0.11.2 (requirements-cpu.txt)")

import torch  # noqa: E402

from nsr.openrlhf import cpu_shim, logprobs  # noqa: E402


@pytest.fixture(scope="module")
def actor_cls():
    cpu_shim.stand_in_flash_attn()  # OpenRLHF's ring-attention module imports flash_attn at its top
    cpu_shim.patch_fp32()  # param_dtype "fp32" (a --nsr.fp32 run) -> float32
    from openrlhf.models.actor import Actor

    full = Actor.forward
    logprobs.install()
    yield Actor, full
    Actor.forward = full  # the rest of the session sees OpenRLHF's own forward
    delattr(Actor, logprobs._ORIGINAL)


def batch(vocab: int, layout: str = "openrlhf", seed: int = 1):
    """6 samples, prompts of 9-12 tokens, responses of 2-9 tokens. ``openrlhf``: OpenRLHF 0.11.2's layout (each
    sample its prompt then its response, right-padded; the action mask spans the sequence, zeros over the prompt:
    samples_generator.py, Experience.concat_experiences). ``left``: left-padded prompts, right-padded responses, the
    action mask over the response columns only."""
    g = torch.Generator().manual_seed(seed)
    P, A, out = 12, 9, []
    for _ in range(6):
        p, a = int(torch.randint(9, P + 1, (1,), generator=g)), int(torch.randint(2, A + 1, (1,), generator=g))
        tokens = torch.randint(3, vocab, (p + a,), generator=g)
        s, m = torch.zeros(P + A, dtype=torch.long), torch.zeros(P + A, dtype=torch.long)
        if layout == "openrlhf":
            s[: p + a], m[: p + a] = tokens, 1
            am = torch.zeros(P + A - 1, dtype=torch.long)
            am[p - 1 : p + a - 1] = 1
        else:
            s[P - p : P + a], m[P - p : P + a] = tokens, 1
            am = torch.zeros(A, dtype=torch.long)
            am[:a] = 1
        out.append((s, m, am))
    return tuple(torch.stack(x) for x in zip(*out))


class HeadRows:
    """Counts the rows the LM head computes."""

    def __init__(self, model):
        self.rows = []
        model.lm_head.register_forward_hook(lambda mod, inp, out: self.rows.append(inp[0].shape[:-1].numel()))


def run(actor, forward, seqs, att, act, **kwargs):
    actor.model.zero_grad()
    lp, out = forward(actor, seqs, act, attention_mask=att, return_output=True, **kwargs)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()  # a gradient through every log-prob
    return lp.detach(), torch.cat([p.grad.float().flatten() for p in actor.model.parameters()]), out


@pytest.mark.parametrize("dtype,layout", [("bf16", "openrlhf"), ("fp32", "openrlhf"), ("fp32", "left")])
def test_compact_log_probs_equal_openrlhfs_on_the_response_rows_only(actor_cls, tiny_qwen2, dtype, layout):
    Actor, full = actor_cls
    actor = Actor(str(tiny_qwen2), attn_implementation="eager", param_dtype=dtype, temperature=0.7)
    assert next(actor.model.parameters()).dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    seqs, att, act = batch(actor.model.config.vocab_size, layout)
    head = HeadRows(actor.model)
    ref_lp, ref_grad, ref_out = run(actor, full, seqs, att, act)
    lp, grad, out = run(actor, Actor.forward, seqs, att, act)
    B, L = seqs.shape
    # OpenRLHF's: every position; compact: from the first position that predicts a response token in any row (the
    # shortest prompt's last token) to the one before the last
    first = int(act.any(0).nonzero()[0]) + L - 1 - act.shape[1]
    assert first > 0 and head.rows == [B * L, B * (L - 1 - first)]
    assert ref_out["logits"].shape[1] == L and out["logits"].shape[1] == L - 1 - first
    assert out["logits"].dtype == torch.float32
    assert torch.equal(lp, ref_lp) and (lp[act == 0] == 0).all()
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    assert grad.abs().max() > 0
    # the old-log-prob call (no output) gives the same tensor
    with torch.no_grad():
        assert torch.equal(Actor.forward(actor, seqs, act, att), full(actor, seqs, act, att))


def test_calls_it_does_not_cover_reach_openrlhfs_forward(actor_cls, tiny_qwen2):
    Actor, full = actor_cls
    actor = Actor(str(tiny_qwen2), attn_implementation="eager", param_dtype="fp32")
    seqs, att, act = batch(actor.model.config.vocab_size)
    head = HeadRows(actor.model)
    B, L = seqs.shape
    assert logprobs.first_action(torch.zeros(2, 5)) == 4  # no response token: the last column only
    with torch.no_grad():
        out = Actor.forward(actor, seqs, act, attention_mask=att, return_output=True, return_entropy=True)
        assert out[1].entropy.shape == (B, L - 1)  # OpenRLHF's entropy over every position
        Actor.forward(actor, seqs, attention_mask=att, return_output=True)  # no action mask: the whole output
        actor.packing_samples = True  # packed samples (flash-attention on the cluster) are not covered
        assert not logprobs.covered(actor, act, {})
        actor.packing_samples = False
        assert logprobs.covered(actor, act, {"return_output": True})
        assert not logprobs.covered(actor, act, {"pixel_values": None})  # multimodal inputs
    assert head.rows == [B * L, B * L]


def test_a_backward_hook_on_the_lm_head_leaves_the_float32_log_probs_alone(actor_cls, tiny_qwen2):
    """The actor profiler (experiments/openrlhf/profile_actor.py) times the LM head's backward with a full backward
    hook, which hands back its output as a view that must not be written in place; in float32 the temperature's
    division used to write into it (RuntimeError in the profiler on the float32 preset)."""
    Actor, _ = actor_cls
    actor = Actor(str(tiny_qwen2), attn_implementation="eager", param_dtype="fp32", temperature=0.7)
    seqs, att, act = batch(actor.model.config.vocab_size)
    ref_lp, ref_grad, _ = run(actor, Actor.forward, seqs, att, act)
    calls = []
    actor.model.lm_head.register_full_backward_hook(lambda mod, gin, gout: calls.append(1))
    lp, grad, _ = run(actor, Actor.forward, seqs, att, act)
    assert calls == [1] and torch.equal(lp, ref_lp) and torch.equal(grad, ref_grad)
