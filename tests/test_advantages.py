"""nsr.compute_advantages: the GRPO baseline and every intervention on it."""

import pytest
import torch

import nsr


def data(n_groups=50, G=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(n_groups * G, generator=g) < 0.4).float()
    ids = torch.arange(n_groups).repeat_interleave(G)
    return rewards, ids[torch.randperm(len(ids), generator=g)]


def by_hand(rewards, ids, std=True):
    out = torch.empty_like(rewards)
    for i in ids.unique():
        sel = ids == i
        r = rewards[sel]
        out[sel] = (r - r.mean()) / (r.std() + 1e-9) if std else r - r.mean()
    return out


def test_group_norm_and_no_std_by_hand():
    rewards, ids = data()
    torch.testing.assert_close(nsr.compute_advantages(rewards, ids, nsr.AdvantageConfig()), by_hand(rewards, ids))
    got = nsr.compute_advantages(rewards, ids, nsr.AdvantageConfig(kind="no_std"))
    torch.testing.assert_close(got, by_hand(rewards, ids, std=False))
    uniform = nsr.compute_advantages(torch.ones(8), torch.zeros(8), nsr.AdvantageConfig())
    assert (uniform == 0).all()  # a group with one reward value carries no signal


def test_positive_only_zeroes_negative_advantages():
    rewards, ids = data()
    base = by_hand(rewards, ids)
    got = nsr.compute_advantages(rewards, ids, nsr.AdvantageConfig(kind="positive_only"))
    torch.testing.assert_close(got, base.clamp(min=0))
    assert (got > 0).any()


def test_random_reward_is_seeded_coin_flips():
    rewards, ids = data(n_groups=500)
    cfg = nsr.AdvantageConfig(kind="random_reward")
    a = nsr.compute_advantages(rewards, ids, cfg, generator=torch.Generator().manual_seed(1))
    b = nsr.compute_advantages(rewards, ids, cfg, generator=torch.Generator().manual_seed(1))
    c = nsr.compute_advantages(rewards, ids, cfg, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    flips = (torch.rand(len(rewards), generator=torch.Generator().manual_seed(1)) < 0.5).float()
    torch.testing.assert_close(a, by_hand(flips, ids))
    assert not torch.equal(a, by_hand(rewards, ids))  # the true rewards are ignored


@pytest.mark.parametrize("mode", ["mult", "add", "add_all"])
def test_noise_is_per_response_after_normalization(mode):
    rewards, ids = data(n_groups=2000)
    base = by_hand(rewards, ids)
    cfg = nsr.AdvantageConfig(noise=0.5, noise_mode=mode)
    got = nsr.compute_advantages(rewards, ids, cfg, generator=torch.Generator().manual_seed(3))
    eps = torch.randn(len(rewards), generator=torch.Generator().manual_seed(3))
    signal = torch.tensor([bool((base[ids == i] != 0).any()) for i in ids.tolist()])  # the response's group has one
    assert signal.any() and (~signal).any()  # both kinds of group are in the data
    expect = {
        "mult": base * (1 + 0.5 * eps),
        "add": torch.where(signal, base + 0.5 * eps, base),
        "add_all": base + 0.5 * eps,
    }[mode]
    torch.testing.assert_close(got, expect)
    if mode != "add_all":
        assert (got[~signal] == 0).all()  # the zero-signal groups stay at zero: no injected signal
    else:
        assert (got[~signal] != 0).all()  # the other reading: random-sign advantages where all rewards were equal


@pytest.mark.parametrize(
    "kwargs, field", [({"kind": "std"}, "kind"), ({"noise": -1.0}, "noise"), ({"noise_mode": "x"}, "noise_mode")]
)
def test_bad_advantage_config(kwargs, field):
    with pytest.raises(ValueError, match=rf"AdvantageConfig\.{field}=.*allowed"):
        nsr.AdvantageConfig(**kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        nsr.compute_advantages(torch.ones(3), torch.tensor([0, 0, 1]), nsr.AdvantageConfig())
    with pytest.raises(ValueError, match="group_ids"):
        nsr.compute_advantages(torch.ones(4), torch.zeros(3), nsr.AdvantageConfig())
