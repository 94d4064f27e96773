"""NSRPolicyLoss against OpenRLHF 0.11.2's real PolicyLoss (loaded from the installed package by file path).

hard delegates to the parent (bit-exact); nsr with delta = 0 and soft with delta = 0 run our own path (nsr.policy_loss
+ OpenRLHF's aggregate_loss) and must equal PolicyLoss too, in loss, gradient, clip_ratio and ppo_kl, across token
and sequence level, dual clip, both aggregation modes and the dp_size > 1 global normalization.
"""

import pytest
import torch
from conftest import make_batch

import nsr
from nsr.openrlhf.loss import NSRPolicyLoss, PolicyLoss
from nsr.openrlhf.reference import load_loss_module
from nsr.openrlhf.settings import NSRSettings

orl = load_loss_module()


def test_parent_is_openrlhfs_policy_loss():
    assert issubclass(NSRPolicyLoss, PolicyLoss)
    assert PolicyLoss.__module__.endswith(".loss") and PolicyLoss.forward.__code__.co_filename.endswith(
        "openrlhf/models/loss.py"
    )


def _case(level, seed, dtype=torch.float64):
    logp, old, adv, mask = make_batch(B=8, T=24, seed=seed, spread=0.6 if level == "token" else 0.02, dtype=dtype)
    return logp.detach(), old, adv * 3, mask  # * 3 reaches the dual-clip region


def _run(loss_fn, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_()
    loss, clip, kl, vllm_kl, is_filter = loss_fn(lp, old, adv, action_mask=mask, **kw)
    loss.backward()
    return loss.detach(), lp.grad, clip, kl, vllm_kl, is_filter


GLOBAL = [
    {},  # per-micro-batch mean
    {"dp_size": 2, "batch_num_tokens": 150.0, "global_batch_size": 20.0},  # global normalization, 2 DP ranks
]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("norm", range(len(GLOBAL)))
@pytest.mark.parametrize(
    "settings", [None, NSRSettings.make(rule="nsr", delta=0.0), NSRSettings.make(rule="soft", delta=0.0)]
)
def test_equals_policy_loss(level, dual_clip, token_level_loss, norm, settings):
    eps = (0.2, 0.28) if level == "token" else (3e-4, 4e-4)
    kwargs = dict(
        clip_eps_low=eps[0],
        clip_eps_high=eps[1],
        dual_clip=dual_clip,
        token_level_loss=token_level_loss,
        policy_loss_type="ppo" if level == "token" else "gspo",
    )
    ref_fn = orl.PolicyLoss(**kwargs)
    ours_fn = NSRPolicyLoss(**kwargs, settings=settings)
    for seed in range(3):
        case = _case(level, seed)
        ref = _run(ref_fn, *case, **GLOBAL[norm])
        ours = _run(ours_fn, *case, **GLOBAL[norm])
        if settings is None:  # hard: the parent's own code, bit for bit
            for a, b in zip(ref[:4], ours[:4]):
                assert torch.equal(a, b)
        else:
            tol = dict(rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(ours[0], ref[0], **tol)
            torch.testing.assert_close(ours[1], ref[1], **tol)
            torch.testing.assert_close(ours[2], ref[2])  # clip_ratio, float32 in both
            torch.testing.assert_close(ours[3], ref[3], **tol)
        assert ours[4] is None and ours[5] is None  # vllm_kl, is_filter_ratio: IS correction off


def test_nsr_rescues_what_policy_loss_zeroes():
    logp, old, adv, mask = _case("token", 0)
    ref = _run(orl.PolicyLoss(0.2, 0.28), logp, old, adv, mask)
    fn = NSRPolicyLoss(0.2, 0.28, settings=NSRSettings.make(rule="nsr", delta=0.2), seed=1)
    fn.sink = {}
    ours = _run(fn, logp, old, adv, mask)
    ratio = (logp - old).exp()
    clipped = mask & (((adv > 0) & (ratio > 1.28)) | ((adv < 0) & (ratio < 0.8)))
    assert clipped.any()
    assert (ref[1][clipped] == 0).all()  # OpenRLHF: clipped tokens get no gradient
    rescued = clipped & (ours[1] != 0)
    assert rescued.any() and not rescued.equal(clipped)  # NSR: some, not all, come back
    n_valid = mask.sum().item()
    assert fn.sink["nsr_rescue_frac"].item() == pytest.approx(rescued.sum().item() / n_valid)
    assert fn.sink["nsr_clip_frac"].item() == pytest.approx(clipped.sum().item() / n_valid)
    assert set(fn.sink) == {f"nsr_{k}" for k in nsr.METRIC_KEYS} | {"nsr_entropy_mc"}
    assert ours[2].item() == pytest.approx(ref[2].item())  # clip_ratio counts what the judge dropped


def test_hard_logs_the_same_metrics_as_the_other_rules():
    logp, old, adv, mask = _case("token", 1)
    fn = NSRPolicyLoss(0.2, 0.28)
    fn.sink = {}
    _, _, clip, *_ = _run(fn, logp, old, adv, mask)
    assert fn.sink["nsr_rescue_frac"].item() == 0.0
    # each side counted by hand: A < 0 below 1 - 0.2, A > 0 above 1 + 0.28, over the valid tokens
    ratio, n = (logp - old).exp(), mask.sum().item()
    low = (mask & (adv < 0) & (ratio < 0.8)).sum().item() / n
    high = (mask & (adv > 0) & (ratio > 1.28)).sum().item() / n
    assert low > 0 and high > 0
    assert fn.sink["nsr_clip_frac_low"].item() == pytest.approx(low)
    assert fn.sink["nsr_clip_frac_high"].item() == pytest.approx(high)
    assert clip.item() == pytest.approx(low + high)  # OpenRLHF's own clip ratio agrees


def test_entropy_estimate_is_the_mean_surprisal_of_the_sampled_tokens():
    """nsr_entropy_mc (the cluster's logged entropy, no full-vocabulary tensor): for tokens drawn from p it is the
    mean of -log p(token), whose expectation is the entropy of p."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 7, generator=g)  # 64 positions, vocabulary 7
    logp_all = logits.log_softmax(-1)
    tokens = torch.multinomial(logp_all.exp(), 400, replacement=True, generator=g)  # (64, 400)
    old = logp_all.gather(1, tokens)
    mask = torch.ones_like(old, dtype=torch.bool)
    mask[:, 300:] = False  # padding is left out
    fn = NSRPolicyLoss(0.2, 0.28)
    fn.sink = {}
    fn(old.clone(), old, torch.ones_like(old), action_mask=mask)
    assert fn.sink["nsr_entropy_mc"].item() == pytest.approx(-old[:, :300].mean().item(), rel=1e-6)
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean().item()
    assert fn.sink["nsr_entropy_mc"].item() == pytest.approx(entropy, abs=0.03)


def test_streams_are_seeded_by_seed_rank_step_and_micro_step():
    case = _case("token", 2)
    settings = NSRSettings.make(rule="nsr", delta=0.3)

    def grads(seed=0, rank=0, step=1, micro=0):
        fn = NSRPolicyLoss(0.2, 0.28, settings=settings, seed=seed, rank=rank)
        fn.start_step(step)
        for _ in range(micro):
            fn.generator(torch.device("cpu"))
        return _run(fn, *case)[1]

    base = grads()
    assert torch.equal(base, grads())  # same (seed, rank, step, micro-step): same draws
    for other in (grads(seed=1), grads(rank=1), grads(step=2), grads(micro=1)):
        assert not torch.equal(base, other)


def test_bad_settings_fail_at_construction():
    with pytest.raises(ValueError, match="LossConfig.rule='nsrr' is not valid; allowed: hard, nsr"):
        NSRSettings.make(rule="nsrr")  # validated where the launcher parses it, before any model loads
    with pytest.raises(ValueError, match="is_correction_level='token'.*only supported with --nsr.rule hard"):
        NSRPolicyLoss(is_correction_level="token", settings=NSRSettings.make(rule="nsr"))
    NSRPolicyLoss(is_correction_level="token")  # hard keeps OpenRLHF's IS correction
