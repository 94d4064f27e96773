"""The clip rules of nsr.objectives: hand-computed cases, invariants, Monte-Carlo agreement with the theory."""

import dataclasses
import math

import pytest
import torch
from conftest import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import nsr
from nsr.objectives import METRIC_KEYS

LO, HI = 0.8, 1.28  # DAPO defaults: eps_low 0.2, eps_high 0.28


def run(logp, old, adv, mask, cfg, seed=0):
    """Loss per token, gradient of its plain sum (so grad = d loss_t / d logp_t), metrics."""
    logp = logp.detach().clone().requires_grad_()
    g = torch.Generator().manual_seed(seed)
    loss, metrics = nsr.policy_loss(logp, old, adv, mask, cfg, generator=g)
    loss.sum().backward()
    return loss.detach(), logp.grad, metrics


def ratios_batch(r, a, dtype=torch.float64):
    """One row per (ratio, advantage) pair, old log-prob -1."""
    r = torch.as_tensor(r, dtype=dtype).reshape(1, -1)
    old = torch.full_like(r, -1.0)
    adv = torch.as_tensor(a, dtype=dtype).reshape(1, -1).expand_as(r).clone()
    return old + r.log(), old, adv, torch.ones_like(r, dtype=torch.bool)


# ---------------------------------------------------------------- hand-computed cases
R = [0.7, 0.9, 1.0, 1.2, 1.3, 1.5]


def test_hard_by_hand_positive_advantage():
    loss, grad, m = run(*ratios_batch(R, 1.0), nsr.LossConfig(rule="hard"))
    torch.testing.assert_close(loss[0], torch.tensor([-0.7, -0.9, -1.0, -1.2, -HI, -HI], dtype=torch.float64))
    torch.testing.assert_close(grad[0], torch.tensor([-0.7, -0.9, -1.0, -1.2, 0.0, 0.0], dtype=torch.float64))
    assert m["clip_frac_high"] == pytest.approx(2 / 6) and m["clip_frac_low"] == 0


def test_hard_by_hand_negative_advantage():
    loss, grad, m = run(*ratios_batch(R, -2.0), nsr.LossConfig(rule="hard"))
    torch.testing.assert_close(loss[0], torch.tensor([1.6, 1.8, 2.0, 2.4, 2.6, 3.0], dtype=torch.float64))
    torch.testing.assert_close(grad[0], torch.tensor([0.0, 1.8, 2.0, 2.4, 2.6, 3.0], dtype=torch.float64))
    assert m["clip_frac_low"] == pytest.approx(1 / 6) and m["clip_frac_high"] == 0


def test_nsr_by_hand_with_known_draws():
    """One z per token, one (B, T) draw from the generator (the documented draw order); only clipped tokens use it."""
    delta = 0.2
    r = [1.0, 1.3, 0.75, 1.5, 0.7]
    a = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    cfg = nsr.LossConfig(rule="nsr", delta=delta)
    for seed in range(20):
        logp, old, _, mask = ratios_batch(r, 1.0)
        loss, grad, m = run(logp, old, a.reshape(1, -1), mask, cfg, seed=seed)
        z = torch.rand(5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 * delta + 1 - delta
        expect_grad = [-1.0]
        expect_loss = [-1.0]
        for zi, ri, ai in zip(z[1:], r[1:], a[1:].tolist()):
            inside = ri * zi <= HI if ai > 0 else ri * zi >= LO
            expect_grad.append(-ai * ri * float(zi) if inside else 0.0)
            expect_loss.append(-ai * ri * float(zi) if inside else -ai * (HI if ai > 0 else LO))
        torch.testing.assert_close(grad[0], torch.tensor(expect_grad, dtype=torch.float64))
        torch.testing.assert_close(loss[0], torch.tensor(expect_loss, dtype=torch.float64))
        assert m["rescue_frac"] == pytest.approx(sum(g != 0 for g in expect_grad[1:]) / 5)


def test_nsr_clean_executor_uses_clean_ratio():
    cfg = nsr.LossConfig(rule="nsr", delta=0.3, executor="clean")
    _, grad, _ = run(*ratios_batch([1.3] * 200, 1.0), cfg)
    assert set(grad[0].tolist()) == {0.0, -1.3}  # rescued tokens get exactly the unclipped gradient


def test_soft_by_hand():
    delta = 0.2
    cfg = nsr.LossConfig(rule="soft", delta=delta)
    c, b = HI, LO
    _, grad, _ = run(*ratios_batch([1.3, 1.7], 1.0), cfg)
    w = ((c / 1.3) ** 2 - (1 - delta) ** 2) / (4 * delta)
    torch.testing.assert_close(grad[0], torch.tensor([-1.3 * w, 0.0], dtype=torch.float64))
    _, grad, _ = run(*ratios_batch([0.75, 0.6], -1.0), cfg)
    w = ((1 + delta) ** 2 - (b / 0.75) ** 2) / (4 * delta)
    torch.testing.assert_close(grad[0], torch.tensor([0.75 * w, 0.0], dtype=torch.float64))
    _, grad, _ = run(*ratios_batch([1.3], 1.0), cfg.replace(executor="clean"))
    torch.testing.assert_close(
        grad[0], torch.tensor([-1.3 * (c / 1.3 - (1 - delta)) / (2 * delta)], dtype=torch.float64)
    )


def test_pushout_by_hand():
    """Far from the boundary nothing is dropped; within reach some are; clipped tokens stay clipped."""
    cfg = nsr.LossConfig(rule="pushout", delta=0.2)
    _, grad, m = run(*ratios_batch([1.0] * 50 + [0.9] * 50, 1.0), cfg)  # reach for A>0: r > 1.28/1.2
    torch.testing.assert_close(grad[0], -torch.tensor([1.0] * 50 + [0.9] * 50, dtype=torch.float64))
    assert m["pushout_frac"] == 0
    _, grad, m = run(*ratios_batch([1.25] * 400 + [1.5] * 10, 1.0), cfg)
    g = grad[0, :400]
    r = (torch.tensor(1.25, dtype=torch.float64).log() - 1 + 1).exp().item()  # 1.25 after the log/exp round trip
    assert set(g.tolist()) == {0.0, -r}  # kept tokens keep executor r, whatever `executor` says
    frac = (g == 0).double().mean().item()
    assert frac == pytest.approx((1.2 - HI / 1.25) / 0.4, abs=0.08)  # P(1.25 z > 1.28)
    assert (grad[0, 400:] == 0).all() and m["pushout_frac"] == pytest.approx((g == 0).sum().item() / 410)


def test_nsr_pushout_by_hand_two_independent_draws():
    """nsr_pushout draws the rescue z first, then the push-out z, each one (B, T) tensor; at sequence level each
    is one value per sequence, shared by its tokens."""
    delta = 0.2
    r = [1.25, 1.3, 0.82, 0.75, 1.0]  # within reach (A > 0), clipped, within reach (A < 0), clipped, far inside
    a = [1.0, 1.0, -1.0, -1.0, 1.0]
    cfg = nsr.LossConfig(rule="nsr_pushout", delta=delta)
    seen = set()
    for seed in range(30):
        logp, old, _, mask = ratios_batch(r, 1.0)
        _, grad, m = run(logp, old, torch.tensor([a], dtype=torch.float64), mask, cfg, seed=seed)
        g = torch.Generator().manual_seed(seed)
        z_rescue = torch.rand(5, generator=g, dtype=torch.float64) * 2 * delta + 1 - delta
        z_push = torch.rand(5, generator=g, dtype=torch.float64) * 2 * delta + 1 - delta
        expect = []
        for i, (ri, ai) in enumerate(zip(r, a)):
            clipped = ri > HI if ai > 0 else ri < LO
            z = float(z_rescue[i] if clipped else z_push[i])
            inside = ri * z <= HI if ai > 0 else ri * z >= LO
            if clipped:  # rescued with the noisy executor, or still clipped
                expect.append(-ai * ri * z if inside else 0.0)
            else:  # kept with the clean executor, or pushed out
                expect.append(-ai * ri if inside else 0.0)
        torch.testing.assert_close(grad[0], torch.tensor(expect, dtype=torch.float64))
        assert m["pushout_frac"].item() == pytest.approx(sum(e == 0 for e in (expect[0], expect[2])) / 5)
        assert m["rescue_frac"].item() == pytest.approx(sum(e != 0 for e in (expect[1], expect[3])) / 5)
        seen.update((i, e == 0) for i, e in enumerate(expect))
    assert {(0, True), (0, False), (1, True), (1, False)} <= seen  # both outcomes reached on both sides of the rule


def test_sequence_level_uses_one_draw_per_sequence_by_hand():
    cfg = nsr.LossConfig(rule="nsr", level="sequence", delta=4e-4)
    s = [cfg.high * 1.0002, cfg.low / 1.0001, 1.0]  # clipped A > 0, clipped A < 0, inside
    a = [1.0, -1.0, 1.0]
    T = 4
    for seed in range(10):
        logp = torch.tensor(s, dtype=torch.float64).log()[:, None].expand(3, T).clone()
        adv = torch.tensor(a, dtype=torch.float64)[:, None].expand(3, T)
        _, grad, m = run(logp, torch.zeros_like(logp), adv, torch.ones(3, T, dtype=torch.bool), cfg, seed=seed)
        z = torch.rand(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 8e-4 + 1 - 4e-4
        sr = logp.exp()[:, 0]  # the sequence ratios after the log / exp round trip
        expect = []
        for i in range(3):
            clipped = i < 2
            inside = sr[i] * z[i] <= cfg.high if a[i] > 0 else sr[i] * z[i] >= cfg.low
            expect.append(-a[i] * sr[i] * (z[i] if clipped else 1.0) if (inside or not clipped) else 0.0)
        # straight-through: each token's gradient is its sequence's per-token weight (loss.sum() over T tokens)
        expect = torch.tensor([float(e) for e in expect], dtype=torch.float64)
        torch.testing.assert_close(grad, expect[:, None].expand(3, T))
        assert m["rescue_frac"].item() == pytest.approx(sum(e != 0 for e in expect[:2]) / 3)


def test_decision_rules_by_hand():
    sigma = 0.1
    r = [1.0, 1.27, 1.3, 0.81]
    a = torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    logp, old, _, mask = ratios_batch(r, 1.0)
    xi = torch.rand(1, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2 * sigma + 1 - sigma
    rn = torch.tensor(r, dtype=torch.float64) * xi[0]
    _, grad, _ = run(logp, old, a, mask, nsr.LossConfig(rule="noisy_decision", ratio_noise=sigma), seed=3)
    kept = torch.where(a[0] > 0, rn <= HI, rn >= LO)
    torch.testing.assert_close(grad[0], torch.where(kept, -a[0] * rn, 0.0))
    _, grad, _ = run(logp, old, a, mask, nsr.LossConfig(rule="clean_decision", ratio_noise=sigma), seed=3)
    kept = torch.tensor([True, True, False, True])
    torch.testing.assert_close(grad[0], torch.where(kept, -a[0] * rn, 0.0))


def test_cispo_and_sapo_by_hand():
    r = torch.tensor(R + [6.0], dtype=torch.float64)
    for a in (2.0, -2.0):
        _, grad, m = run(*ratios_batch(r, a), nsr.LossConfig(rule="cispo"))
        torch.testing.assert_close(grad[0], -a * r.clamp(max=5.0))  # never dropped; the weight is capped above only
        assert m["clip_frac_high"] == pytest.approx(1 / 7) and m["clip_frac_low"] == 0
    _, grad, m = run(*ratios_batch(r, -2.0), nsr.LossConfig(rule="cispo", cispo_cap=None))  # verl: 1 + eps_high
    torch.testing.assert_close(grad[0], 2.0 * r.clamp(max=HI))
    assert m["clip_frac_high"] == pytest.approx(3 / 7)
    r = torch.tensor(R, dtype=torch.float64)
    for a, tau in ((1.5, 1.0), (-1.5, 1.05)):
        loss, grad, _ = run(*ratios_batch(R, a), nsr.LossConfig(rule="sapo"))
        s = torch.sigmoid(tau * (r - 1))
        torch.testing.assert_close(loss[0], -(4 / tau) * s * a)
        torch.testing.assert_close(grad[0], -4 * s * (1 - s) * r * a)
    _, grad, _ = run(*ratios_batch([1.0], 1.0), nsr.LossConfig(rule="sapo"))
    assert grad.item() == pytest.approx(-1.0)  # on policy the gate has slope 1: plain policy gradient


def test_noclip_by_hand():
    r = torch.tensor(R, dtype=torch.float64)
    for a in (1.5, -1.5):
        loss, grad, m = run(*ratios_batch(R, a), nsr.LossConfig(rule="noclip"))
        torch.testing.assert_close(loss[0], -a * r)
        torch.testing.assert_close(grad[0], -a * r)  # no trust region: every token keeps its gradient
        assert all(m[k] == 0 for k in ("clip_frac_low", "clip_frac_high", "clip_frac", "rescue_frac", "pushout_frac"))


def test_dual_clip():
    cfg = nsr.LossConfig(rule="nsr", dual_clip=3.0)
    loss, grad, m = run(*ratios_batch([2.0, 3.5, 0.5], -1.0), cfg)
    assert grad[0, 1] == 0 and loss[0, 1] == pytest.approx(3.0) and grad[0, 0] == pytest.approx(2.0)
    assert m["clip_frac_low"] == pytest.approx(1 / 3)  # only r = 0.5; the dual-clipped token is not counted


# ---------------------------------------------------------------- invariants, over random batches
BATCH = st.builds(
    make_batch,
    B=st.integers(1, 6),
    T=st.integers(1, 12),
    seed=st.integers(0, 10_000),
    spread=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
    pad=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    adv_per_token=st.booleans(),
)
ALL_CFGS = [
    nsr.LossConfig(rule=r, level=lvl, ratio_noise=0.2 if "decision" in r else 0.0)
    for r in nsr.RULES
    for lvl in nsr.RULES.info(r)["levels"]
]


@settings(max_examples=40, deadline=None)
@given(batch=BATCH, delta=st.sampled_from([0.05, 0.2, 0.5]), level=st.sampled_from(["token", "sequence"]))
def test_nsr_delta_zero_is_hard_bit_for_bit(batch, delta, level):
    hard = run(*batch, nsr.LossConfig(rule="hard", level=level))
    for rule in ("nsr", "soft", "nsr_pushout", "pushout"):
        got = run(*batch, nsr.LossConfig(rule=rule, level=level, delta=0.0))
        assert torch.equal(got[0], hard[0]) and torch.equal(got[1], hard[1])
        assert all(torch.equal(got[2][k], hard[2][k]) for k in METRIC_KEYS)
    for rule in ("noisy_decision", "clean_decision"):
        got = run(*batch, nsr.LossConfig(rule=rule, level=level, ratio_noise=0.0))
        assert torch.equal(got[0], hard[0]) and torch.equal(got[1], hard[1])


@settings(max_examples=40, deadline=None)
@given(batch=BATCH, delta=st.sampled_from([0.05, 0.2, 0.5]), executor=st.sampled_from(["noisy", "clean"]))
def test_nsr_touches_clipped_tokens_only_and_rescues_inside(batch, delta, executor):
    logp, old, adv, mask = batch
    cfg = nsr.LossConfig(rule="nsr", delta=delta, executor=executor)
    _, g_hard, _ = run(*batch, cfg.replace(rule="hard"))
    loss, g, m = run(*batch, cfg)
    r = (logp.detach() - old).exp()
    clipped = mask & (((adv > 0) & (r > HI)) | ((adv < 0) & (r < LO)))
    assert torch.equal(g[~clipped], g_hard[~clipped])  # untouched where not clipped
    rescued = clipped & (g != 0)
    assert m["rescue_frac"].item() == pytest.approx(rescued.sum().item() / max(mask.sum().item(), 1), abs=1e-6)
    if rescued.any():
        z = (g / (-adv * r))[rescued]  # implied multiplier of each rescued token's unclipped gradient
        if executor == "clean":
            torch.testing.assert_close(z, torch.ones_like(z))
        else:
            tol = 1e-5 if z.dtype == torch.float32 else 1e-12
            assert ((z >= 1 - delta - tol) & (z <= 1 + delta + tol)).all()
            rz = (r * (g / (-adv * r)))[rescued]
            inside = torch.where(adv[rescued] > 0, rz <= HI * (1 + tol), rz >= LO * (1 - tol))
            assert inside.all()
    deep = clipped & (((adv > 0) & (r >= HI / (1 - delta))) | ((adv < 0) & (r <= LO / (1 + delta))))
    assert (g[deep] == 0).all()  # the rescue is boundary-local


@settings(max_examples=30, deadline=None)
@given(batch=BATCH, cfg=st.sampled_from(ALL_CFGS))
def test_padding_gets_zero_loss_and_gradient(batch, cfg):
    logp, old, adv, mask = batch
    logp = logp.detach().clone()
    logp[~mask] = float("nan")  # garbage in padding must not leak
    loss, g, m = run(logp, old, adv, mask, cfg)
    assert (loss[~mask] == 0).all() and (g[~mask] == 0).all()
    assert torch.isfinite(loss[mask]).all() and torch.isfinite(g[mask]).all()
    assert set(m) >= set(METRIC_KEYS) and all(torch.isfinite(v) and v.dim() == 0 for v in m.values())
    for k in ("clip_frac_low", "clip_frac_high", "rescue_frac", "pushout_frac"):
        assert 0 <= m[k] <= 1
    assert m["clip_frac"].item() == pytest.approx((m["clip_frac_low"] + m["clip_frac_high"]).item())


@settings(max_examples=20, deadline=None)
@given(batch=BATCH, cfg=st.sampled_from(ALL_CFGS), seed=st.integers(0, 100))
def test_same_seed_same_numbers(batch, cfg, seed):
    a, b = run(*batch, cfg, seed=seed), run(*batch, cfg, seed=seed)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_soft_is_deterministic_and_equals_expected_weight():
    logp, old, adv, mask = make_batch(B=32, T=64, spread=0.4)
    for level in ("token", "sequence"):
        for executor in ("noisy", "clean"):
            cfg = nsr.LossConfig(rule="soft", level=level, executor=executor, delta=0.3 if level == "token" else 4e-4)
            _, g1, _ = run(logp, old, adv, mask, cfg, seed=1)
            _, g2, _ = run(logp, old, adv, mask, cfg, seed=2)
            assert torch.equal(g1, g2)
    cfg = nsr.LossConfig(rule="soft", delta=0.3)
    r = (logp.detach() - old).exp()
    _, g, _ = run(logp, old, adv, mask, cfg)
    expect = torch.where(mask, -adv * r * nsr.expected_weight(r, adv, cfg), 0.0)
    torch.testing.assert_close(g, expect)


@pytest.mark.parametrize("cfg", ALL_CFGS, ids=lambda c: f"{c.rule}-{c.level}")
def test_extreme_log_ratios_stay_finite(cfg):
    logp, old, adv, mask = make_batch(B=4, T=8, dtype=torch.float32)
    logp = logp.detach().clone()
    logp[0, :4] = old[0, :4] + 500.0
    logp[1, :4] = old[1, :4] - 500.0
    logp[2, :4] = old[2, :4] + 21.0
    loss, g, m = run(logp, old, adv, mask, cfg)
    assert torch.isfinite(loss).all() and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in m.values())
    # like OpenRLHF: no gradient where the log-ratio is beyond the +-20 clamp; GPPO / CE-GPPO / DPPO-TV keep theirs
    # there, as their sources do (tests/test_related_rules.py checks the values)
    if cfg.level == "token" and cfg.rule not in ("gppo", "ce_gppo", "dppo_tv"):
        assert (g[:3, :4] == 0).all()


def test_empty_mask_aggregates_to_zero_not_nan():
    logp, old, adv, _ = make_batch(B=3, T=5)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for cfg in ALL_CFGS:
        loss, m = nsr.policy_loss(logp, old, adv, mask, cfg)
        for mode in ("token-mean", "seq-mean-token-mean"):
            agg = nsr.aggregate(loss, mask, mode)
            assert agg.item() == 0 and not torch.isnan(agg)
            agg.backward(retain_graph=True)
        assert all(torch.isfinite(v) for v in m.values())
        assert (logp.grad == 0).all()


def test_aggregate_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert nsr.aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert nsr.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="mode"):
        nsr.aggregate(loss, mask, "sum")


def test_input_shapes_are_checked_and_per_response_advantages_broadcast():
    logp, old, adv, mask = make_batch(B=3, T=5)
    full = run(logp, old, adv, mask, nsr.LossConfig())
    per_resp = run(logp, old, adv[:, 0], mask, nsr.LossConfig())
    assert torch.equal(full[1], per_resp[1])
    with pytest.raises(ValueError, match="old_log_probs"):
        nsr.policy_loss(logp, old[:, :3], adv, mask, nsr.LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        nsr.policy_loss(logp, old, adv[:, :2], mask, nsr.LossConfig())
    with pytest.raises(ValueError, match="mask"):
        nsr.policy_loss(logp, old, adv, mask[:2], nsr.LossConfig())


# ---------------------------------------------------------------- Monte Carlo vs the theory
# the executor option only changes rescued tokens, so pushout and noisy_decision run with the default one
@pytest.mark.parametrize(
    "rule, executor",
    [("nsr", "noisy"), ("nsr", "clean"), ("nsr_pushout", "noisy"), ("nsr_pushout", "clean"), ("pushout", "noisy"),
     ("noisy_decision", "noisy")],
)  # fmt: skip
def test_monte_carlo_mean_gradient_matches_expected_weight(rule, executor):
    delta = 0.3
    cfg = nsr.LossConfig(
        rule=rule, delta=delta, executor=executor, ratio_noise=delta if rule == "noisy_decision" else 0
    )
    ratios = torch.tensor([0.5, 0.6, 0.65, 0.7, 0.75, 0.79, 0.85, 1.0, 1.1, 1.2, 1.27, 1.3, 1.4, 1.6, 1.8, 2.0])
    M = 40_000
    for sign in (1.0, -1.0):
        r = ratios.double().repeat_interleave(M).reshape(len(ratios), M)
        old = torch.zeros_like(r)
        _, g, _ = run(r.log(), old, torch.full_like(r, sign), torch.ones_like(r, dtype=torch.bool), cfg, seed=7)
        w_mc = (g / (-sign * r)).mean(1)
        w_th = nsr.expected_weight(ratios.double(), sign, cfg)
        se = 0.6 / math.sqrt(M)
        assert (w_mc - w_th).abs().max() < 5 * se, (sign, w_mc, w_th)


def test_monte_carlo_sequence_level_one_draw_per_sequence():
    cfg = nsr.LossConfig(rule="nsr", level="sequence")  # GSPO defaults: eps 3e-4 / 4e-4, delta 4e-4
    c = cfg.high
    S, T = 40_000, 3
    for s, sign in ((c * 1.0002, 1.0), (cfg.low / 1.0001, -1.0)):
        logp = torch.full((S, T), math.log(s), dtype=torch.float64)
        _, g, m = run(
            logp, torch.zeros_like(logp), torch.full_like(logp, sign), torch.ones(S, T, dtype=torch.bool), cfg
        )
        # loss_tok repeats the sequence loss on each of its T tokens and u = mean_t log r_t, so d sum(loss_tok) /
        # d logp_t = T * coef / T: each token's gradient is the sequence's weighted unclipped gradient
        per_seq = g[:, 0] / (-sign * s)
        rescued = (g != 0).any(1)
        assert ((g != 0).all(1) == rescued).all()  # all tokens of a sequence share its fate
        assert per_seq.mean().item() == pytest.approx(
            nsr.expected_weight(s, sign, cfg).item(), abs=5 * 0.6 / math.sqrt(S)
        )
        assert m["rescue_frac"].item() == pytest.approx(rescued.double().mean().item())


# ---------------------------------------------------------------- registry and config
def test_every_registered_rule_resolves_and_runs():
    assert {"hard", "nsr", "soft", "pushout", "nsr_pushout", "noisy_decision", "clean_decision", "cispo", "sapo",
            "noclip"} <= set(nsr.RULES)  # fmt: skip
    logp, old, adv, mask = make_batch()
    for name in nsr.RULES:
        assert callable(nsr.RULES[name])
        cfg = nsr.LossConfig(rule=name, ratio_noise=0.1 if "decision" in name else 0.0)
        assert nsr.LossConfig(**{**dataclasses.asdict(cfg)}).rule == name
        loss, m = nsr.policy_loss(logp, old, adv, mask, cfg)
        assert set(m) == set(METRIC_KEYS)
        nsr.aggregate(loss, mask).backward()
        if nsr.RULES.info(name).get("weight") is not None:
            w = nsr.expected_weight(torch.linspace(0.5, 2, 7), 1.0, cfg)
            assert (w >= 0).all() and (w <= 1).all()
    with pytest.raises(ValueError, match="hard, nsr, soft"):
        nsr.RULES["nope"]


def test_rule_input_gives_masked_log_probs():
    """RuleInput.log_probs / old_log_probs: 0 on padding (whatever the caller put there), gradient to log_probs only."""
    logp, old, adv, mask = make_batch(B=3, T=5)
    logp = logp.detach().clone()
    logp[~mask] = float("nan")
    logp.requires_grad_()
    old = old.clone().requires_grad_()
    x = nsr.objectives.RuleInput(None, None, adv, nsr.LossConfig(), None, mask, logp, old)
    lp, op = x.log_probs, x.old_log_probs
    assert (lp[~mask] == 0).all() and (op[~mask] == 0).all() and torch.equal(lp[mask], logp[mask])
    assert not op.requires_grad
    (lp.sum() + op.sum()).backward()
    assert torch.equal(logp.grad, mask.to(logp.dtype)) and old.grad is None


def test_every_rule_is_defined_at_its_registered_levels():
    for name in nsr.RULES:
        levels = nsr.RULES.info(name)["levels"]
        assert set(levels) <= {"token", "sequence"} and levels
    assert all(nsr.RULES.info(n)["levels"] == ("token", "sequence") for n in ("hard", "nsr", "cispo", "noclip"))


@pytest.mark.parametrize("ratio_noise", [0.0, 0.1])
def test_needs_stale_ratios_is_the_rules_gradient_at_ratio_one(ratio_noise):
    """Every rule's declaration (nsr.needs_stale_ratios) against its gradient when every ratio is 1 (old = log pi):
    a rule needs stale ratios exactly when that gradient is the hard clip's, at every level it is defined at."""
    logp, _, adv, mask = make_batch(B=6, T=9)
    logp = logp.double()
    for name in nsr.RULES:
        for level in nsr.RULES.info(name)["levels"]:
            noise = ratio_noise if "decision" in name else 0.0
            cfg = nsr.LossConfig(rule=name, level=level, ratio_noise=noise)
            grads = []
            for c in (cfg, nsr.LossConfig(level=level)):
                lp = logp.detach().clone().requires_grad_()
                loss, _ = nsr.policy_loss(lp, lp.detach(), adv.double(), mask, c, torch.Generator().manual_seed(0))
                (g,) = torch.autograd.grad(loss.sum(), lp)
                grads.append(g)
            same = torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)
            assert nsr.needs_stale_ratios(cfg) == (same and name != "hard"), (name, level, noise)
    assert not nsr.needs_stale_ratios(nsr.LossConfig(rule="clip_cov"))
    assert nsr.needs_stale_ratios(nsr.LossConfig(rule="nsr"))


def test_expected_weight_has_the_rules_of_the_registry():
    """The weights are registered with the rules, so expected_weight knows exactly the registered names."""
    for name in ("hard", "nsr", "soft", "pushout", "nsr_pushout", "noisy_decision", "clean_decision", "cispo",
                 "sapo", "noclip"):  # fmt: skip
        assert nsr.RULES.info(name)["weight"] is not None
    assert nsr.RULES.info("soft")["weight"] is nsr.RULES.info("nsr")["weight"]  # the twin's weight by construction
    with pytest.raises(ValueError, match="LossConfig.rule='nope'"):
        nsr.RULES.info("nope")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rule": "nope"}, "rule"),
        ({"rule": ""}, "rule"),
        ({"delta": -0.1}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"eps_low": 0.0}, "eps_low"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_high": 0.0}, "eps_high"),
        ({"executor": "fuzzy"}, "executor"),
        ({"level": "batch"}, "level"),
        ({"rule": "noisy_decision", "ratio_noise": 1.0}, "ratio_noise"),
        ({"rule": "nsr", "ratio_noise": 0.1}, "ratio_noise"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"delta": "0.2"}, "delta"),
        ({"sapo_tau_neg": 0}, "sapo_tau_neg"),
        ({"cispo_cap": 0.5}, "cispo_cap"),
        ({"cispo_cap": "5"}, "cispo_cap"),
        *(
            ({k: v}, k)
            for k in ("eps_low", "eps_high", "delta", "dual_clip", "sapo_tau_pos", "sapo_tau_neg", "cispo_cap")
            for v in (math.nan, math.inf, -math.inf)
        ),
        *(({"rule": "noisy_decision", "ratio_noise": v}, "ratio_noise") for v in (math.nan, math.inf)),
    ],
)
def test_bad_loss_config_names_field_and_allowed_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"LossConfig\.{field}=.*allowed"):
        nsr.LossConfig(**kwargs)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_numbers_are_refused_with_the_range(value):
    with pytest.raises(ValueError, match=r"LossConfig\.delta=.*allowed: a finite number with 0 <= delta < 1"):
        nsr.LossConfig(delta=value)
    with pytest.raises(ValueError, match=r"LossConfig\.cispo_cap=.*allowed: a finite number with cispo_cap >= 1"):
        nsr.LossConfig(rule="cispo", cispo_cap=value)


def test_level_defaults():
    tok, seq = nsr.LossConfig(), nsr.LossConfig(level="sequence")
    assert (tok.eps_low, tok.eps_high, tok.delta, tok.cispo_cap) == (0.2, 0.28, 0.2, 5.0)
    assert (seq.eps_low, seq.eps_high, seq.delta) == (3e-4, 4e-4, 4e-4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tok.delta = 0.5
