"""No host-device sync in the loss path: every rule, both levels, forward + aggregate + metrics + backward.

On a GPU, an op whose output shape or value must be known on the host (``nonzero``, ``.item()``, boolean indexing,
``unique``, ...) makes the host wait for the device. Two checks that run on CPU:

* a ``TorchDispatchMode`` that raises on every aten op of that kind (what ``.item()``, ``float(t)``, ``bool(t)``,
  ``t[mask]`` and ``torch.where(cond)`` become);
* a run on the ``meta`` device, where tensors have no data at all, so any read of a value (``.tolist()``,
  ``.numpy()``, ``.item()``, a Python ``if`` on a tensor) fails, including host copies that produce no aten op on CPU.
"""

import pytest
import torch
from conftest import make_batch
from torch.utils._python_dispatch import TorchDispatchMode

import nsr

aten = torch.ops.aten
SYNCING = {
    aten.nonzero,
    aten.nonzero_numpy,
    aten.argwhere,
    aten._local_scalar_dense,  # .item(), float(t), int(t), bool(t)
    aten.item,
    aten.is_nonzero,
    aten.equal,
    aten.masked_select,
    aten.unique_dim,
    aten._unique,
    aten._unique2,
    aten.unique_consecutive,
    aten.repeat_interleave,
    aten.bincount,
    aten.histc,
}


class NoSync(TorchDispatchMode):
    """Raises on any aten op that needs a value of a tensor on the host; also on indexing with a bool tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in SYNCING:
            raise AssertionError(f"host-device sync: {func}")
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
                raise AssertionError(f"host-device sync: {func} with a boolean index")
        return func(*args, **kwargs)


CFGS = [
    nsr.LossConfig(rule=rule, level=level, ratio_noise=0.1 if "decision" in rule else 0.0, **extra)
    for rule in nsr.RULES
    for level in nsr.RULES.info(rule)["levels"]
    for extra in ({}, {"dual_clip": 3.0}, {"executor": "clean"}, {"cispo_cap": None})
]


def _loss_path(logp, old, adv, mask, cfg, generator):
    loss, metrics = nsr.policy_loss(logp, old, adv, mask, cfg, generator=generator)
    total = nsr.aggregate(loss, mask, "token-mean") + nsr.aggregate(loss, mask, "seq-mean-token-mean")
    total.backward()
    return loss, metrics


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c.rule}-{c.level}-{c.dual_clip}-{c.executor}-{c.cispo_cap}")
def test_no_syncing_op_in_forward_backward_and_metrics(cfg):
    logp, old, adv, mask = make_batch(B=6, T=10, spread=0.5 if cfg.level == "token" else 0.05)
    logp = logp.detach().requires_grad_()
    with NoSync():
        loss, metrics = _loss_path(logp, old, adv * 3, mask, cfg, torch.Generator().manual_seed(0))
    assert loss.shape == (6, 10) and logp.grad is not None and set(metrics) == set(nsr.METRIC_KEYS)


@pytest.mark.parametrize("cfg", CFGS[::4], ids=lambda c: f"{c.rule}-{c.level}")
def test_runs_on_the_meta_device(cfg):
    B, T = 5, 7
    logp = torch.empty(B, T, device="meta").requires_grad_()
    old = torch.empty(B, T, device="meta")
    adv = torch.empty(B, device="meta")
    mask = torch.empty(B, T, dtype=torch.bool, device="meta")
    loss, metrics = _loss_path(logp, old, adv, mask, cfg, None)
    assert loss.device.type == "meta" and loss.shape == (B, T)
    assert logp.grad.shape == (B, T) and all(v.shape == () for v in metrics.values())


@pytest.mark.parametrize(
    "bad",
    [
        lambda x: x.sum().item(),
        lambda x: float(x.sum()),
        lambda x: bool((x > 0).any()),
        lambda x: x[x > 0],
        lambda x: torch.where(x > 0),
        lambda x: x.nonzero(),
        lambda x: x.masked_select(x > 0),
        lambda x: x.unique(),
    ],
)
def test_the_checks_catch_syncing_code(bad):
    """Positive controls: the dispatch mode rejects each way of reading a tensor's value on the host."""
    x = torch.randn(4, 5)
    with pytest.raises(AssertionError, match="host-device sync"), NoSync():
        bad(x)


def test_meta_catches_host_copies():
    x = torch.empty(3, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        x.tolist()
    with pytest.raises((NotImplementedError, RuntimeError, TypeError)):
        x.numpy()
