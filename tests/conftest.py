import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_batch(B=8, T=16, seed=0, spread=0.3, pad=True, dtype=torch.float64, adv_per_token=False):
    """A padded (B, T) batch whose ratios straddle both clip bounds."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=dtype) * 0.5 - 2.0
    logp = (old + torch.randn(B, T, generator=g, dtype=dtype) * spread).requires_grad_()
    if adv_per_token:
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).clone()
        adv[0] = 0.0  # a zero-advantage response
    if pad:
        lens = torch.randint(0, T + 1, (B,), generator=g)
        lens[-1] = T  # at least one full row
        mask = torch.arange(T)[None, :] < lens[:, None]
    else:
        mask = torch.ones(B, T, dtype=torch.bool)
    return logp, old, adv, mask


@pytest.fixture
def batch():
    return make_batch()
