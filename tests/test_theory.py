"""nsr.expected_weight against the closed forms of docs/method.md ("Expected behaviour")."""

import pytest
import torch

import nsr

C, B = 1.28, 0.8


@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_closed_forms_both_sides_both_executors(delta):
    noisy = nsr.LossConfig(rule="nsr", delta=delta)
    clean = noisy.replace(executor="clean")
    r = torch.linspace(C * 1.0001, C / (1 - delta) * 0.9999, 50, dtype=torch.float64)
    torch.testing.assert_close(nsr.expected_weight(r, 1, noisy), ((C / r) ** 2 - (1 - delta) ** 2) / (4 * delta))
    torch.testing.assert_close(nsr.expected_weight(r, 1, clean), (C / r - (1 - delta)) / (2 * delta))
    r = torch.linspace(B / (1 + delta) * 1.0001, B * 0.9999, 50, dtype=torch.float64)
    torch.testing.assert_close(nsr.expected_weight(r, -1, noisy), ((1 + delta) ** 2 - (B / r) ** 2) / (4 * delta))
    torch.testing.assert_close(nsr.expected_weight(r, -1, clean), ((1 + delta) - B / r) / (2 * delta))


@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_boundary_drop_and_zero_beyond_the_rescue_zone(delta):
    noisy = nsr.LossConfig(rule="nsr", delta=delta)
    clean = noisy.replace(executor="clean")
    eps = 1e-9
    w = lambda r, s, cfg: nsr.expected_weight(torch.tensor(r, dtype=torch.float64), s, cfg).item()  # noqa: E731
    assert w(C + eps, 1, noisy) == pytest.approx((2 - delta) / 4, abs=1e-6)
    assert w(B - eps, -1, noisy) == pytest.approx((2 + delta) / 4, abs=1e-6)
    assert w(C + eps, 1, clean) == pytest.approx(0.5, abs=1e-6)
    assert w(B - eps, -1, clean) == pytest.approx(0.5, abs=1e-6)
    assert w(C / (1 - delta), 1, noisy) == 0 and w(C / (1 - delta) * 1.5, 1, clean) == 0
    assert w(B / (1 + delta), -1, noisy) == 0 and w(B / (1 + delta) / 1.5, -1, clean) == 0
    # not clipped, A = 0 included: weight 1 (including r beyond the region on the other side)
    for r, s in [(1.0, 1), (0.5, 1), (1.0, -1), (2.0, -1), (5.0, 0), (0.1, 0)]:
        assert w(r, s, noisy) == 1.0


def test_weight_decays_monotonically_like_inverse_square():
    cfg = nsr.LossConfig(rule="nsr", delta=0.3)
    r = torch.linspace(C + 1e-6, C / 0.7 - 1e-6, 200, dtype=torch.float64)
    w = nsr.expected_weight(r, 1, cfg)
    assert (w[1:] < w[:-1]).all()
    torch.testing.assert_close(w + (0.7**2) / (4 * 0.3), (C / r) ** 2 / (4 * 0.3))  # (c/r)^2 - const


def test_delta_zero_is_the_hard_clip_step():
    r = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0], dtype=torch.float64)
    for rule in ("nsr", "soft", "pushout", "nsr_pushout"):
        cfg = nsr.LossConfig(rule=rule, delta=0.0)
        torch.testing.assert_close(nsr.expected_weight(r, 1, cfg), (r <= C).double())
        torch.testing.assert_close(nsr.expected_weight(r, -1, cfg), (r >= B).double())
    torch.testing.assert_close(nsr.expected_weight(r, 1, nsr.LossConfig()), (r <= C).double())


def test_other_rules():
    r = torch.tensor([0.5, 1.0, 1.05, 1.25, 1.5], dtype=torch.float64)
    push = nsr.LossConfig(rule="pushout", delta=0.2)
    # pushout keeps an unclipped token with probability P(r z <= c); clipped ones get 0
    expect = torch.tensor([1.0, 1.0, 1.0, (C / 1.25 - 0.8) / 0.4, 0.0], dtype=torch.float64)
    torch.testing.assert_close(nsr.expected_weight(r, 1, push), expect)
    both = push.replace(rule="nsr_pushout")
    torch.testing.assert_close(nsr.expected_weight(r, 1, both)[:4], expect[:4])
    assert nsr.expected_weight(1.5, 1, both).item() == pytest.approx(((C / 1.5) ** 2 - 0.64) / 0.8)
    cispo = nsr.LossConfig(rule="cispo", cispo_cap=1.2)
    torch.testing.assert_close(nsr.expected_weight(r, 1, cispo), r.clamp(max=1.2) / r)  # no lower bound
    torch.testing.assert_close(nsr.expected_weight(r, -1, cispo.replace(cispo_cap=None)), r.clamp(max=C) / r)
    torch.testing.assert_close(nsr.expected_weight(r, 1, nsr.LossConfig(rule="noclip")), torch.ones_like(r))
    sapo = nsr.LossConfig(rule="sapo")
    s = torch.sigmoid(r - 1)
    torch.testing.assert_close(nsr.expected_weight(r, 1, sapo), 4 * s * (1 - s))
    dual = nsr.LossConfig(rule="hard", dual_clip=3.0)
    assert nsr.expected_weight(4.0, -1, dual).item() == 0 and nsr.expected_weight(2.0, -1, dual).item() == 1
    noisy_dec = nsr.LossConfig(rule="noisy_decision", ratio_noise=0.1)
    assert nsr.expected_weight(1.0, 1, noisy_dec).item() == pytest.approx(1.0)
    assert 0 < nsr.expected_weight(1.2, 1, noisy_dec).item() < 1  # the noisy judge drops some kept tokens too


def test_is_clipped_is_the_hard_rules_judge():
    cfg = nsr.LossConfig()
    r = torch.tensor([0.7, 0.8, 0.9, 1.28, 1.3, 0.7, 1.3, 1.3], dtype=torch.float64)
    a = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    expect = [True, False, False, False, True, False, False, False]  # strict bounds; the other side and A = 0 kept
    assert nsr.theory.is_clipped(r, a, cfg).tolist() == expect
    low, high = nsr.theory.clip_sides(r, a, cfg)
    assert low.tolist() == [True] + [False] * 7 and high.tolist() == [False] * 4 + [True] + [False] * 3
