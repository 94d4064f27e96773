"""The related clip rules of nsr/related.py (GPPO, CE-GPPO, DCPO, Clip-Cov, KL-Cov, DPPO-TV).

Hand-computed values and gradients; each gradient against autograd of the formula written the way its source's code
writes it (an independent, literal implementation); padding inert; extreme ratios finite; seeded draws
reproducible; no host-device sync; token level only, sequence level refused. A few seconds.
"""

import math

import pytest
import torch
from conftest import make_batch
from test_no_sync import NoSync

import nsr
from nsr.related import dcpo_bounds

NEW = ("gppo", "ce_gppo", "dcpo", "clip_cov", "kl_cov", "dppo_tv")
LO, HI = 0.8, 1.28


def run(logp, old, adv, mask, cfg, seed=0):
    """Loss per token, d loss_t / d logp_t, metrics."""
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = nsr.policy_loss(logp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(seed))
    loss.sum().backward()
    return loss.detach(), logp.grad, metrics


def row(ratios, advs, old_prob=None, dtype=torch.float64):
    """One row of tokens with these ratios and advantages; old probability ``old_prob`` (default e^-1)."""
    r = torch.tensor(ratios, dtype=dtype).reshape(1, -1)
    q = torch.full_like(r, math.exp(-1.0)) if old_prob is None else torch.tensor(old_prob, dtype=dtype).reshape(1, -1)
    adv = torch.tensor(advs, dtype=dtype).reshape(1, -1)
    return (q * r).log(), q.log(), adv, torch.ones_like(r, dtype=torch.bool)


def t(values):
    return torch.tensor([values], dtype=torch.float64)


# ---------------------------------------------------------------- registry, levels, config
def test_rules_are_registered_token_level_only():
    for name in NEW:
        assert name in nsr.RULES and nsr.RULES.info(name)["levels"] == ("token",)
        with pytest.raises(
            ValueError, match=rf"LossConfig\.level='sequence' is not valid for rule='{name}'; allowed: token"
        ):
            nsr.LossConfig(rule=name, level="sequence")
    assert nsr.RULES.info("gppo")["weight"] is not None and nsr.RULES.info("dcpo").get("weight") is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"ce_gppo_beta1": -0.1}, "ce_gppo_beta1"),
        ({"ce_gppo_beta2": math.nan}, "ce_gppo_beta2"),
        ({"dcpo_cap": 1.0}, "dcpo_cap"),
        ({"clip_cov_frac": 0.0}, "clip_cov_frac"),
        ({"clip_cov_frac": 1.5}, "clip_cov_frac"),
        ({"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_ub"),
        ({"kl_cov_frac": -1e-3}, "kl_cov_frac"),
        ({"kl_cov_coef": -1.0}, "kl_cov_coef"),
        ({"dppo_delta": 0.0}, "dppo_delta"),
        ({"dppo_delta": 1.5}, "dppo_delta"),
        ({"dppo_cap": 0.5}, "dppo_cap"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"LossConfig\.{field}=.*allowed"):
        nsr.LossConfig(**kwargs)


def test_published_defaults():
    c = nsr.LossConfig()
    assert (c.ce_gppo_beta1, c.ce_gppo_beta2, c.dcpo_cap) == (0.5, 1.0, 10.0)
    assert (c.clip_cov_frac, c.clip_cov_lb, c.clip_cov_ub, c.kl_cov_frac, c.kl_cov_coef) == (2e-4, 1.0, 5.0, 2e-3, 1.0)
    assert (c.dppo_delta, c.dppo_cap) == (0.15, 20.0)


# ---------------------------------------------------------------- GPPO / CE-GPPO by hand
R = [0.5, 0.9, 1.2, 1.5]


def test_gppo_by_hand():
    cfg = nsr.LossConfig(rule="gppo")
    loss, g, m = run(*row(R, [1.0] * 4), cfg)
    torch.testing.assert_close(loss, t([-0.5, -0.9, -1.2, -HI]))  # the hard-clip value where clipped
    torch.testing.assert_close(g, t([-0.5, -0.9, -1.2, -HI]))  # ... and the gradient of the bound, not 0
    loss, g, m = run(*row(R, [-2.0] * 4), cfg)
    torch.testing.assert_close(loss, t([2 * LO, 1.8, 2.4, 3.0]))
    torch.testing.assert_close(g, t([2 * LO, 1.8, 2.4, 3.0]))
    assert m["clip_frac_low"] == m["rescue_frac"] == 0.25 and m["clip_frac_high"] == 0


def test_ce_gppo_by_hand_and_its_limits():
    cfg = nsr.LossConfig(rule="ce_gppo", ce_gppo_beta1=0.5, ce_gppo_beta2=0.75)
    loss, g, _ = run(*row([0.5, 1.0, 1.5, 0.5, 1.5], [-2.0, 1.0, 1.0, 1.0, -1.0]), cfg)
    torch.testing.assert_close(g, t([2 * 0.5 * LO, -1.0, -0.75 * HI, -0.5, 1.5]))
    torch.testing.assert_close(loss, t([2 * 0.5 * LO, -1.0, -0.75 * HI, -0.5, 1.5]))
    batch = make_batch(B=6, T=12, spread=0.5)
    as_gppo = run(*batch, nsr.LossConfig(rule="ce_gppo", ce_gppo_beta1=1.0, ce_gppo_beta2=1.0))
    gppo = run(*batch, nsr.LossConfig(rule="gppo"))
    assert torch.equal(as_gppo[0], gppo[0]) and torch.equal(as_gppo[1], gppo[1])
    zero = run(*batch, nsr.LossConfig(rule="ce_gppo", ce_gppo_beta1=0.0, ce_gppo_beta2=0.0))
    hard = run(*batch, nsr.LossConfig(rule="hard"))
    torch.testing.assert_close(zero[1], hard[1])  # beta = 0: the clipped gradient is gone again
    assert zero[2]["rescue_frac"] == 0


# ---------------------------------------------------------------- DCPO by hand
def test_dcpo_bounds_by_hand():
    cfg = nsr.LossConfig(rule="dcpo")
    lo, hi = dcpo_bounds(torch.tensor([1.0, 0.5, 0.01, 0.001], dtype=torch.float64), cfg)
    torch.testing.assert_close(lo, torch.tensor([(1 + math.sqrt(0.2)) / 2, 0.5, 0.5, 0.5], dtype=torch.float64))
    want_hi = [(1 + math.sqrt(1 + 1.12)) / 2, (1 + math.sqrt(1 + 2.24)) / 2, (1 + math.sqrt(1 + 112)) / 2, 10.0]
    torch.testing.assert_close(hi, torch.tensor(want_hi, dtype=torch.float64))
    assert hi[1].item() == pytest.approx(1.4)


def test_dcpo_by_hand():
    cfg = nsr.LossConfig(rule="dcpo")
    q = [0.5, 0.5, 1.0, 0.5, 0.01]
    loss, g, m = run(*row([1.3, 1.5, 0.7, 0.6, 4.0], [1.0, 1.0, -1.0, -1.0, 1.0], old_prob=q), cfg)
    lo1 = (1 + math.sqrt(0.2)) / 2
    torch.testing.assert_close(loss, t([-1.3, -1.4, lo1, 0.6, -4.0]))
    torch.testing.assert_close(g, t([-1.3, 0.0, 0.0, 0.6, -4.0]))  # hard would drop the 1.3, 0.6 and 4.0 tokens
    assert m["clip_frac_high"] == 0.2 and m["clip_frac_low"] == 0.2


# ---------------------------------------------------------------- Clip-Cov / KL-Cov by hand
def _cov_batch():
    """Two rows of 4 tokens, r = 1 (on-policy), advantages per token; centred covariances by hand."""
    logp = torch.tensor([[-0.5, -3.0, -0.5, -3.0], [-1.0, -2.5, -1.75, -1.75]], dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0], [3.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    # mean A = 2 / 8 = 0.25, mean log pi = -14 / 8 = -1.75
    cov = (adv - 0.25) * (logp + 1.75)
    return logp, logp.clone(), adv, torch.ones_like(adv, dtype=torch.bool), cov


def test_clip_cov_detaches_eligible_tokens_by_hand():
    logp, old, adv, mask, cov = _cov_batch()
    # cov: [[2.1875, -2.1875, -2.8125, 2.8125], [2.0625, 0.9375, 0, 0]]: tokens (0,0), (0,3), (1,0) are in (1, 5)
    eligible = (cov > 1) & (cov < 5)
    assert eligible.sum() == 3 and eligible[0, 0] and eligible[0, 3] and eligible[1, 0]
    cfg = nsr.LossConfig(rule="clip_cov", clip_cov_frac=0.5)  # k = floor(0.5 x 8) = 4 >= 3: all of them
    loss, g, m = run(logp, old, adv, mask, cfg)
    hard_loss, hard_g, _ = run(logp, old, adv, mask, nsr.LossConfig(rule="hard"))
    torch.testing.assert_close(loss, torch.where(eligible, 0.0, hard_loss))
    torch.testing.assert_close(g, torch.where(eligible, 0.0, hard_g))
    assert m["pushout_frac"] == 3 / 8 and m["clip_frac"] == 0
    cfg = nsr.LossConfig(rule="clip_cov", clip_cov_frac=0.2)  # k = 1: one of the three, at random
    picked = set()
    for seed in range(30):
        loss, g, m = run(logp, old, adv, mask, cfg, seed=seed)
        zero = (g == 0) & (adv != 0)
        assert zero.sum() == 1 and (zero & ~eligible).sum() == 0 and m["pushout_frac"] == 1 / 8
        picked.add(tuple(zero.nonzero()[0].tolist()))
    assert picked == {(0, 0), (0, 3), (1, 0)}


def test_clip_cov_never_touches_tokens_the_clip_already_drops():
    logp, old, adv, mask, cov = _cov_batch()
    old = old.clone()
    old[0, 0] = logp[0, 0] - math.log(1.5)  # r = 1.5, A = 2 > 0: clipped by PPO, cov unchanged (log pi is)
    cfg = nsr.LossConfig(rule="clip_cov", clip_cov_frac=0.5)
    _, g, m = run(logp, old, adv, mask, cfg)
    assert g[0, 0] == 0 and m["clip_frac_high"] == 1 / 8 and m["pushout_frac"] == 2 / 8


def test_kl_cov_by_hand():
    logp, old, adv, mask, cov = _cov_batch()
    old = logp - torch.tensor([[0.1, -0.2, 0.3, -0.4], [0.5, 0.6, -0.1, 0.2]], dtype=torch.float64)
    cfg = nsr.LossConfig(rule="kl_cov", kl_cov_frac=0.25, kl_cov_coef=0.5)  # k = 2: (0,3) 2.8125, (0,0) 2.1875
    loss, g, m = run(logp, old, adv, mask, cfg)
    u = logp - old
    r = u.exp()
    top = torch.zeros_like(mask)
    top[0, 3] = top[0, 0] = True
    torch.testing.assert_close(loss, -adv * r + torch.where(top, 0.5 * u.abs(), 0.0))
    torch.testing.assert_close(g, -adv * r + torch.where(top, 0.5 * u.sign(), 0.0))
    assert m["clip_frac"] == 0 and m["pushout_frac"] == 0


# ---------------------------------------------------------------- DPPO-TV by hand
def test_dppo_tv_by_hand():
    cfg = nsr.LossConfig(rule="dppo_tv")
    q = [0.5, 0.5, 0.5, 0.5, 0.001, 0.5]
    pi = [0.7, 0.6, 0.3, 0.4, 0.05, 0.3]
    r = [p / o for p, o in zip(pi, q)]
    loss, g, m = run(*row(r, [1.0, 1.0, -1.0, -1.0, 2.0, 1.0], old_prob=q), cfg)
    # A > 0 drops pi - q > 0.15 (token 0), A < 0 drops pi - q < -0.15 (token 2); A > 0 keeps any drop in pi
    want_g = [0.0, -1.2, 0.0, 0.8, -2 * 20.0, -0.6]  # -A sg(min(r, 20)); token 4 has r = 50, truncated to 20
    torch.testing.assert_close(g, t(want_g))
    want_loss = [0.0, -1.2 * math.log(1.2), 0.0, 0.8 * math.log(0.8), -40.0 * math.log(50.0), -0.6 * math.log(0.6)]
    torch.testing.assert_close(loss, t(want_loss))
    assert m["clip_frac_high"] == pytest.approx(1 / 6) and m["clip_frac_low"] == pytest.approx(1 / 6)


# ---------------------------------------------------------------- gradients vs the sources' own formulas
def _verl_style(rule, logp, old, adv, mask, cfg):
    """The loss as each source's code writes it (Klear, lime-RL/DCPO, verl), on the valid tokens; a deterministic
    reference for every rule but clip_cov, whose random subset is fixed by clip_cov_frac = 1 (all eligible)."""
    lp = torch.where(mask, logp, 0.0)
    ratio = torch.exp(lp - old)
    pg1 = -adv * ratio
    if rule in ("gppo", "ce_gppo"):
        b1, b2 = (cfg.ce_gppo_beta1, cfg.ce_gppo_beta2) if rule == "ce_gppo" else (1.0, 1.0)
        low_mask = (ratio < LO) & (adv < 0)
        high_mask = (ratio > HI) & (adv > 0)
        rd = ratio.detach()
        out = torch.where(low_mask, -b1 * LO / rd * ratio * adv, pg1)
        return torch.where(high_mask, -b2 * HI / rd * ratio * adv, out)
    if rule == "dcpo":
        q = old.exp()
        low_c = 1 - 4 * cfg.eps_low / q
        low_c = low_c * (low_c >= 0)
        lo = (1 + torch.sqrt(low_c)) / 2
        hi = torch.clamp((1 + torch.sqrt(1 + 4 * cfg.eps_high / q)) / 2, 0, max(cfg.dcpo_cap, 10))
        return torch.maximum(pg1, -adv * torch.clamp(ratio, lo, hi))
    if rule == "clip_cov":
        pg2 = -adv * torch.clamp(ratio, LO, HI)
        n = mask.sum()
        cov = (adv - (adv * mask).sum() / n) * (lp - (lp.detach() * mask).sum() / n)
        detached = (pg2 <= pg1) & mask & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
        return torch.maximum(pg1, pg2) * (~detached).to(pg1.dtype)  # verl: corr = 0 on the chosen tokens
    if rule == "kl_cov":
        idx = mask.reshape(-1).nonzero().squeeze(1)
        a, lpv = adv.reshape(-1)[idx], lp.detach().reshape(-1)[idx]
        cov = (a - a.mean()) * (lpv - lpv.mean())
        k = max(1, int(len(cov) * cfg.kl_cov_frac))
        top = torch.zeros(mask.numel(), dtype=torch.bool)
        top[idx[torch.topk(cov, k).indices]] = True
        return pg1 + torch.where(top.view_as(mask), cfg.kl_cov_coef * (lp - old).abs(), 0.0)
    if rule == "dppo_tv":
        prob, old_prob = lp.exp(), old.exp()
        valid = torch.where(adv > 0, (prob - old_prob) <= cfg.dppo_delta, (prob - old_prob) >= -cfg.dppo_delta)
        return -adv * torch.clamp(ratio, max=cfg.dppo_cap).detach() * lp * valid.detach().to(lp.dtype)
    raise AssertionError(rule)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gppo_is_klears_one_line_clamp_form(seed):
    """GPPO as the authors publish it (KlearReasoner README / compute_gppo_loss): PPO's max with the clamp bounds
    written as (1 -/+ eps) / sg(r) * r, no dual clip. Same value and gradient; in particular the A < 0 tokens below
    the bound keep d L / d log pi = |A| (1 - eps_low) however small r is (the push behind the collapse)."""
    logp, old, adv, mask = make_batch(B=8, T=16, seed=seed, spread=1.5, adv_per_token=True)
    loss, g, m = run(logp, old, adv, mask, nsr.LossConfig(rule="gppo"))
    lp = logp.detach().clone().requires_grad_()
    ratio = torch.exp(torch.where(mask, lp, 0.0) - old)
    rd = ratio.detach()
    ref = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, LO / rd * ratio, HI / rd * ratio))
    ref = torch.where(mask, ref, 0.0)
    (ref_g,) = torch.autograd.grad(ref.sum(), lp)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, torch.where(mask, ref_g, 0.0))
    deep = mask & (adv < 0) & (rd < 0.1)  # far below the bound
    assert deep.any() and m["clip_frac_low"] > 0
    torch.testing.assert_close(g[deep], (-adv * LO)[deep])


@pytest.mark.parametrize("rule", NEW)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_matches_autograd_of_the_sources_formula(rule, seed):
    logp, old, adv, mask = make_batch(B=8, T=16, seed=seed, spread=0.6, adv_per_token=True)
    adv = adv * 2.0  # covariances reach the (1, 5) band
    old = old.clamp(max=-0.05)  # probabilities below 1
    extra = {"clip_cov_frac": 1.0} if rule == "clip_cov" else {"kl_cov_frac": 0.1} if rule == "kl_cov" else {}
    cfg = nsr.LossConfig(rule=rule, **extra)
    loss, g, m = run(logp, old, adv, mask, cfg)
    if rule == "clip_cov":
        assert m["pushout_frac"] > 0  # some tokens are detached: the comparison covers them
    ref_logp = logp.detach().clone().requires_grad_()
    ref = torch.where(mask, _verl_style(rule, ref_logp, old, adv, mask, cfg), 0.0)
    (ref_g,) = torch.autograd.grad(ref.sum(), ref_logp)
    torch.testing.assert_close(g, torch.where(mask, ref_g, 0.0))
    if rule == "dppo_tv":  # verl writes the value with log pi, nsr with log r = log pi - log q: a constant apart
        kept = (ref.detach() != 0).to(old.dtype)
        w = (logp.detach() - old).exp().clamp(max=cfg.dppo_cap)
        ref = ref + kept * adv * w * old
    torch.testing.assert_close(loss, torch.where(mask, ref.detach(), 0.0))


# ---------------------------------------------------------------- padding, extremes, seeds, sync
@pytest.mark.parametrize("rule", NEW)
def test_padded_tokens_are_inert(rule):
    logp, old, adv, mask = make_batch(B=6, T=12, spread=0.5, adv_per_token=True)
    cfg = nsr.LossConfig(rule=rule, clip_cov_frac=0.1, kl_cov_frac=0.1)
    clean = run(logp, old, adv, mask, cfg, seed=3)
    dirty_logp, dirty_old, dirty_adv = logp.detach().clone(), old.clone(), adv.clone()
    dirty_logp[~mask], dirty_old[~mask], dirty_adv[~mask] = float("nan"), 1e6, -1e9
    dirty = run(dirty_logp, dirty_old, dirty_adv, mask, cfg, seed=3)
    assert (dirty[0][~mask] == 0).all() and (dirty[1][~mask] == 0).all()
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])
    for k in nsr.METRIC_KEYS:
        assert torch.equal(dirty[2][k], clean[2][k]), k


@pytest.mark.parametrize("rule", NEW)
def test_extreme_ratios_stay_finite(rule):
    logp, old, adv, mask = make_batch(B=4, T=8, dtype=torch.float32, adv_per_token=True)
    logp = logp.detach().clone()
    logp[0, :4] = old[0, :4] + 500.0
    logp[1, :4] = old[1, :4] - 500.0
    logp[2, :4] = old[2, :4] + 21.0
    old = old.clone()
    old[3, :2] = -200.0  # q underflows to 0 in float32
    loss, g, m = run(logp, old, adv, mask, nsr.LossConfig(rule=rule, clip_cov_frac=0.2, kl_cov_frac=0.2))
    assert torch.isfinite(loss).all() and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_clip_cov_draws_are_seeded():
    logp, old, adv, mask = make_batch(B=16, T=32, spread=0.3, adv_per_token=True)
    cfg = nsr.LossConfig(rule="clip_cov", clip_cov_frac=0.02)
    a, b = run(logp, old, adv * 3, mask, cfg, seed=7), run(logp, old, adv * 3, mask, cfg, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = run(logp, old, adv * 3, mask, cfg, seed=8)
    assert not torch.equal(a[1], c[1])
    n = int(mask.sum())
    assert a[2]["pushout_frac"].item() == pytest.approx(math.floor(0.02 * n) / n)  # exactly k tokens


@pytest.mark.parametrize("rule", NEW)
def test_no_host_device_sync(rule):
    logp, old, adv, mask = make_batch(B=6, T=10, spread=0.5, adv_per_token=True)
    logp = logp.detach().requires_grad_()
    cfg = nsr.LossConfig(rule=rule, clip_cov_frac=0.1, kl_cov_frac=0.1)
    with NoSync():
        loss, metrics = nsr.policy_loss(logp, old, adv * 3, mask, cfg, generator=torch.Generator().manual_seed(0))
        nsr.aggregate(loss, mask).backward()
    assert logp.grad is not None and set(metrics) == set(nsr.METRIC_KEYS)


# ---------------------------------------------------------------- the OpenRLHF backend
def test_openrlhf_argv_is_accepted_by_openrlhfs_parser(tmp_path):
    from test_openrlhf_argv import _cfg, _check_command

    from experiments.config import ConfigError

    for rule, extra in (
        ("gppo", []),
        ("ce_gppo", ["loss.ce_gppo_beta1=0.75"]),
        ("dcpo", ["loss.dcpo_cap=8.0", "loss.dual_clip=10.0"]),
        ("clip_cov", ["loss.clip_cov_frac=1e-3", "loss.clip_cov_ub=4.0"]),
        ("kl_cov", ["loss.kl_cov_frac=2e-4", "loss.kl_cov_coef=0.5"]),
        ("dppo_tv", ["loss.dppo_delta=0.1", "loss.dppo_cap=1e4"]),
    ):
        cfg = _cfg("qwen2.5-math-7b-dapo", [f"loss.rule={rule}", *extra])
        _check_command(cfg, tmp_path / rule)  # the --nsr.<field> flags round-trip to this LossConfig
    with pytest.raises(ConfigError, match=r"loss\.level='sequence' is not valid for rule='gppo'; allowed: token"):
        _cfg("qwen3-30b-a3b-gspo", ["loss.rule=gppo"])


@pytest.mark.parametrize("rule", NEW)
def test_openrlhf_loss_subclass_computes_the_rule(rule):
    from nsr.openrlhf.loss import NSRPolicyLoss
    from nsr.openrlhf.settings import NSRSettings

    logp, old, adv, mask = make_batch(B=6, T=12, spread=0.5)
    adv = adv * 3
    fn = NSRPolicyLoss(0.2, 0.28, None, True, "ppo", settings=NSRSettings.make(rule=rule, clip_cov_frac=0.1))
    lp = logp.detach().clone().requires_grad_()
    loss = fn(lp, old, adv, action_mask=mask)[0]
    loss.backward()
    cfg = nsr.LossConfig(rule=rule, clip_cov_frac=0.1)
    ref_lp = logp.detach().clone().requires_grad_()
    ref_tok, _ = nsr.policy_loss(ref_lp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(0))
    ref = nsr.aggregate(ref_tok, mask, "token-mean")
    ref.backward()
    if rule == "clip_cov":  # its own seeded stream (seed, rank, step): the same count of detached tokens
        assert ((lp.grad == 0) & mask & (adv != 0)).sum() == ((ref_lp.grad == 0) & mask & (adv != 0)).sum()
    else:
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(lp.grad, ref_lp.grad)


# ---------------------------------------------------------------- beyond the loss path's log-ratio clamp (+/-20)
def test_gppo_and_dppo_keep_their_gradient_at_extreme_ratios():
    """GPPO's kept gradient is (1 - eps_low) A at any ratio (Klear: (1 - eps)/sg(r) * r), DPPO-TV's -A min(r, C) on a
    kept token (verl: log pi, unclamped); both were 0 beyond |log r| = 20 when the carrier was the clamped ratio."""
    logp, old, adv, mask = row([math.exp(-25.0)], [-1.0])  # A < 0, r = e^-25: deep below 1 - eps_low
    for rule, beta in (("gppo", 1.0), ("ce_gppo", 0.75)):
        _, g, _ = run(logp, old, adv, mask, nsr.LossConfig(rule=rule, ce_gppo_beta1=0.75))
        assert g.item() == pytest.approx(beta * LO)  # d loss / d log pi = -A * beta * (1 - eps_low)
    # A > 0, q = e^-30, pi = e^-5: r = e^25, pi - q = 0.0067 <= delta, so the token is kept; weight min(r, C) = C
    logp, old, adv, mask = row([math.exp(25.0)], [1.0], old_prob=[math.exp(-30.0)])
    loss, g, _ = run(logp, old, adv, mask, nsr.LossConfig(rule="dppo_tv", dppo_cap=1.0e4))
    assert g.item() == pytest.approx(-1.0e4) and loss.item() == pytest.approx(-1.0e4 * 25.0)
    # padding with garbage log-probs stays inert (no NaN reaches the gradient)
    logp, old, adv, mask = row([math.exp(-25.0), 1.0], [-1.0, -1.0])
    logp = logp.clone()
    logp[0, 1], mask[0, 1] = float("nan"), False
    for rule in ("gppo", "dppo_tv"):
        _, g, _ = run(logp, old, adv, mask, nsr.LossConfig(rule=rule))
        assert torch.isfinite(g).all() and g[0, 1] == 0


def test_every_rule_is_named_where_the_rules_are_listed():
    """LossConfig.rule's docstring and docs/method.md name every registered rule and the file that defines it."""
    import inspect
    from pathlib import Path

    from nsr.registry import RULES

    root = Path(__file__).resolve().parents[1]
    doc = inspect.getsource(nsr.config.LossConfig)
    method = (root / "docs" / "method.md").read_text()
    for name in RULES:
        where = Path(inspect.getsourcefile(RULES[name])).name
        assert f"{name}" in doc and f"nsr/{where}" in doc, name
        assert f"nsr/{where}" in method and name in method, name
