"""rule="hard" equals OpenRLHF 0.11.2's PolicyLoss (loss, gradient, clip ratio, ppo_kl).

OpenRLHF's loss is loaded from the installed package by file path (nsr.openrlhf.reference), so the code
compared against is OpenRLHF's own, not a copy.
"""

import pytest
import torch
from conftest import make_batch

import nsr
from nsr.openrlhf.reference import installed_version, load_loss_module

orl = load_loss_module()


def test_the_installed_openrlhf_is_the_pinned_one():
    assert installed_version() == "0.11.2"


# OpenRLHF's gspo forces the sequence-mean reduction, so sequence level pairs with seq-mean-token-mean only
@pytest.mark.parametrize(
    "level, mode", [("token", "token-mean"), ("token", "seq-mean-token-mean"), ("sequence", "seq-mean-token-mean")]
)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hard_equals_openrlhf_policy_loss(level, dual_clip, mode, seed, dtype):
    logp, old, adv, mask = make_batch(B=8, T=32, seed=seed, spread=0.6 if level == "token" else 0.02, dtype=dtype)
    adv = adv * 3  # reach the dual-clip region
    eps = (0.2, 0.28) if level == "token" else (3e-4, 4e-4)
    ref = orl.PolicyLoss(
        clip_eps_low=eps[0],
        clip_eps_high=eps[1],
        dual_clip=dual_clip,
        token_level_loss=mode == "token-mean",
        policy_loss_type="ppo" if level == "token" else "gspo",
    )
    lp_ref = logp.detach().clone().requires_grad_()
    ref_loss, ref_clip, ref_kl, _, _ = ref(lp_ref, old, adv, action_mask=mask)
    ref_loss.backward()

    cfg = nsr.LossConfig(rule="hard", level=level, eps_low=eps[0], eps_high=eps[1], dual_clip=dual_clip)
    lp = logp.detach().clone().requires_grad_()
    loss_tok, metrics = nsr.policy_loss(lp, old, adv, mask, cfg)
    loss = nsr.aggregate(loss_tok, mask, mode)
    loss.backward()

    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(lp.grad, lp_ref.grad, **tol)
    # OpenRLHF reports clip_ratio in float32 (``.float()``), so compare at that precision
    torch.testing.assert_close(metrics["clip_frac"].float(), ref_clip.float())
    torch.testing.assert_close(metrics["approx_kl"], ref_kl.to(dtype), **tol)
    assert 0 < ref_clip < 1 or level == "sequence"


def test_aggregate_equals_openrlhf_aggregate_loss():
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 10, generator=g, dtype=torch.float64)
    _, _, _, mask = make_batch(B=6, T=10, seed=3)
    for mode in ("token-mean", "seq-mean-token-mean"):
        ours = nsr.aggregate(loss, mask, mode)
        ref = orl.aggregate_loss(loss, mask, token_level_loss=mode == "token-mean")
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
