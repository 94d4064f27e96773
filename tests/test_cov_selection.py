"""Clip-Cov and KL-Cov select their tokens by a partial selection (topk of a static count), not a full sort: the same
tokens as the stable sort they replace, ties included, with no host sync; and the loss benchmark times them next to
verl 0.9.1's own clip_cov / kl_cov (``python -m experiments.bench.loss --verl``)."""

import pytest
import torch

from experiments.bench import loss as bench_loss
from nsr.related import first_k, static_budget, token_budget


def stable_sort_first_k(key, eligible, k, descending):
    """The selection the rules made before: one stable sort, the rank of every token, a comparison with k."""
    far = -torch.inf if descending else torch.inf
    flat = torch.where(eligible, key, far).reshape(-1)
    order = torch.argsort(flat, descending=descending, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel()))
    return eligible & (rank.view_as(key) < k)


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("levels", [3, 50, 10**6])
def test_partial_selection_is_the_stable_sorts_with_ties(descending, levels):
    """Keys drawn from few levels make ties at the k-th key; every k, eligible sets from none to all."""
    g = torch.Generator().manual_seed(levels)
    for trial in range(40):
        B, T = 1 + trial % 5, 1 + (7 * trial) % 13
        key = torch.randint(0, levels, (B, T), generator=g).double() / levels
        eligible = torch.rand(B, T, generator=g) < (trial % 6) / 5
        frac = [1e-3, 0.05, 0.3, 1.0][trial % 4]
        k = token_budget(frac, eligible | (torch.rand(B, T, generator=g) < 0.5))
        got = first_k(key, eligible, k, descending, k_max=static_budget(frac, key))
        assert torch.equal(got, stable_sort_first_k(key, eligible, k, descending)), (trial, key, eligible, k)
        assert int(got.sum()) == min(int(k), int(eligible.sum()))


def test_static_budget_bounds_every_budget():
    valid = torch.zeros(64, 4096, dtype=torch.bool)
    assert (
        static_budget(2e-4, valid) == 52
        and static_budget(2e-3, valid) == 524
        and static_budget(1.0, valid) == 4096 * 64
    )
    assert static_budget(1e-9, valid) == 1
    for n in (0, 1, 1000, 64 * 4096):
        valid.view(-1)[:n] = True
        assert int(token_budget(2e-4, valid)) <= static_budget(2e-4, valid)


def test_loss_benchmark_times_clip_cov_and_kl_cov_next_to_verl(capsys):
    pytest.importorskip("verl", reason="verl is installed by `make venv` (pip install --no-deps verl==0.9.1)")
    result = bench_loss.main(["--B", "4", "--T", "64", "--repeats", "2", "--warmup", "1", "--verl"])
    names = [r["name"] for r in result["rows"]]
    assert names[-2:] == ["verl:clip_cov", "verl:kl_cov"] and "clip_cov" in names and "kl_cov" in names
    printed = capsys.readouterr().out
    assert "clip_cov: " in printed and "x verl's clip_cov (target <= 1.2x" in printed
    assert "kl_cov: " in printed and "x verl's kl_cov (target <= 1.2x" in printed
    assert "slowest rule: " in printed and "slowest rule: verl" not in printed
    with pytest.raises(SystemExit):
        bench_loss.main(["--verl", "--level", "sequence"])
