"""The premise meter (nsr.premise): its counts against a token-by-token reading of the definition, no host sync,
its refusals, and its rates."""

import math

import pytest
import torch
from conftest import make_batch
from test_no_sync import NoSync

import nsr
from nsr.premise import N_BINS, RATE_KEYS, PremiseMeter, counts_row, premise_counts, rates, reach, token_ratio

CFGS = [
    nsr.LossConfig(rule="nsr", delta=0.2),
    nsr.LossConfig(rule="hard", delta=0.5),
    nsr.LossConfig(rule="soft", delta=0.1, eps_low=0.1, eps_high=0.3),
    nsr.LossConfig(rule="nsr", delta=0.0),
    nsr.LossConfig(rule="pushout", delta=0.2, dual_clip=3.0),
    nsr.LossConfig(rule="cispo", delta=0.2),
]


def _by_hand(logp, old, adv, mask, cfg, generator) -> torch.Tensor:
    """The meter's definition read token by token: the hard clip's test, depth into the zone from its two edges, the
    gradient of the token's own loss."""
    loss, _ = nsr.policy_loss(logp, old, adv, mask, cfg, generator=generator)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    out = torch.zeros(2, 3, N_BINS + 1, dtype=torch.float64)
    B, T = logp.shape
    for i in range(B):
        for t in range(T):
            a = float(adv[i, t])
            r = math.exp(min(max(float(logp[i, t].detach() - old[i, t]), -20.0), 20.0))
            if not mask[i, t] or a == 0 or not ((a > 0 and r > hi) or (a < 0 and r < lo)):
                continue
            side = 0 if a > 0 else 1
            if cfg.delta == 0:
                depth = math.inf
            elif a > 0:
                depth = (r - hi) / (hi / (1 - cfg.delta) - hi)
            else:
                depth = (lo - r) / (lo - lo / (1 + cfg.delta))
            b = min(int(math.floor(depth * N_BINS)) if depth < math.inf else N_BINS, N_BINS)
            out[side, 0, b] += 1
            g = float(grad[i, t])
            if g != 0:
                out[side, 1, b] += 1
                out[side, 2, b] += g / (-a * r)
    return out


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c.rule}-{c.delta}")
def test_counts_follow_the_definition(cfg):
    meter, want = PremiseMeter(cfg), torch.zeros(2, 3, N_BINS + 1, dtype=torch.float64)
    for seed in range(3):  # three updates of a step accumulate
        logp, old, adv, mask = make_batch(B=12, T=9, seed=seed, spread=0.6)
        want += _by_hand(logp, old, adv, mask, cfg, torch.Generator().manual_seed(seed))
        loss, _ = nsr.policy_loss(logp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(seed))
        meter.add(loss, logp, adv, mask, old_log_probs=old)
    got = meter.counts()
    assert torch.equal(got[:, :2], want[:, :2])  # clipped and rescued: exact counts
    torch.testing.assert_close(got[:, 2], want[:, 2], rtol=1e-12, atol=1e-12)
    assert want[:, 0].sum() > 20  # the batches do clip, on both sides
    assert want[0, 0].sum() > 0 and want[1, 0].sum() > 0
    assert meter.tokens.item() == sum(make_batch(B=12, T=9, seed=s, spread=0.6)[3].sum().item() for s in range(3))
    if cfg.rule == "hard":
        assert got[:, 1].sum() == 0  # hard keeps no clipped token
    if cfg.rule == "nsr" and cfg.delta > 0:
        assert got[:, 1, :N_BINS].sum() > 0 and got[:, 1, N_BINS].sum() == 0  # rescues inside the zone only


def test_row_is_the_ratio_bins_format_and_reset_starts_a_step():
    cfg = nsr.LossConfig(rule="nsr", delta=0.2)
    logp, old, adv, mask = make_batch(B=10, T=8, spread=0.6)
    meter = PremiseMeter(cfg)
    loss, _ = nsr.policy_loss(logp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(0))
    meter.add(loss, logp, adv[:, 0], mask, ratio=token_ratio(logp, old))  # (B,) advantages, ratio given
    row = meter.row(3)
    assert list(row) == ["step", "delta", "executor"] + [
        f"{s}_{w}" for s in ("pos", "neg") for w in ("clipped", "rescued", "weight")
    ] + ["tokens", "tokens_adv"]
    assert row["step"] == 3 and row["delta"] == 0.2 and row["executor"] == "noisy"
    assert row["tokens"] == mask.sum().item() and row["tokens_adv"] == (mask & (adv[:, :1] != 0)).sum().item()
    assert all(len(row[k]) == N_BINS + 1 for k in row if k.endswith(("clipped", "rescued", "weight")))
    assert all(isinstance(v, int) for v in row["pos_clipped"] + row["neg_rescued"])
    assert sum(row["pos_clipped"]) + sum(row["neg_clipped"]) > 0
    meter.reset()
    assert meter.counts().sum() == 0 and meter.tokens.item() == 0 and meter.tokens_adv.item() == 0
    assert counts_row(meter.counts(), 4, cfg)["pos_weight"] == [0.0] * (N_BINS + 1)


def test_add_reads_nothing_back_from_the_device():
    """No aten op that needs a value on the host (tests/test_no_sync.py), and the same on the meta device, where any
    read of a value fails."""
    cfg = nsr.LossConfig(rule="nsr", delta=0.2)
    logp, old, adv, mask = make_batch(B=6, T=10, spread=0.5)
    meter = PremiseMeter(cfg, device="cpu")
    with NoSync():
        loss, _ = nsr.policy_loss(logp, old, adv, mask, cfg, generator=torch.Generator().manual_seed(0))
        meter.add(loss, logp, adv, mask, old_log_probs=old)
        meter.add(loss, logp, adv, mask, old_log_probs=old)
    assert meter.counts()[:, 0].sum() > 0

    logp = torch.empty(4, 7, device="meta").requires_grad_()
    old, adv = torch.empty(4, 7, device="meta"), torch.empty(4, 1, device="meta")
    mask = torch.empty(4, 7, dtype=torch.bool, device="meta")
    meter = PremiseMeter(cfg)
    loss, _ = nsr.policy_loss(logp, old, adv, mask, cfg, generator=torch.Generator(device="cpu"))
    meter.add(loss, logp, adv, mask, old_log_probs=old)
    assert meter.counts().device.type == "meta" and meter.counts().shape == (2, 3, N_BINS + 1)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="level='sequence' is not valid; allowed: token"):
        PremiseMeter(nsr.LossConfig(rule="nsr", level="sequence"))
    with pytest.raises(TypeError, match="nsr.LossConfig"):
        PremiseMeter({"rule": "nsr"})
    logp, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match="old_log_probs or ratio"):
        PremiseMeter(nsr.LossConfig()).add(logp * 1.0, logp, adv, mask)


def test_rates_are_the_counts_per_token():
    counts = torch.zeros(2, 3, N_BINS + 1, dtype=torch.float64)
    counts[0, 0, :3] = 2.0  # A > 0: 6 in the zone, 4 deeper, 3 rescued of weight 2.5
    counts[0, 0, N_BINS] = 4.0
    counts[0, 1, 1], counts[0, 2, 1] = 3.0, 2.5
    counts[1, 0, N_BINS] = 5.0  # A < 0: all deeper
    got = {k: v.item() for k, v in rates(counts, torch.tensor(100.0)).items()}
    assert list(got) == list(RATE_KEYS)
    assert got == pytest.approx(
        {
            "pos_clipped_zone": 0.06,
            "pos_clipped_deep": 0.04,
            "pos_rescued": 0.03,
            "pos_weight": 0.025,
            "neg_clipped_zone": 0.0,
            "neg_clipped_deep": 0.05,
            "neg_rescued": 0.0,
            "neg_weight": 0.0,
        }  # fmt: skip
    )
    assert reach(0.06, 0.04) == pytest.approx(0.6) and reach(0.0, 0.05) == 0.0 and math.isnan(reach(0.0, 0.0))


# ---------------------------------------------------------------- one meter, every backend's path
def _backend_batch():
    """A padded float32 batch (the dtype the trainers use) whose ratios straddle both bounds and NSR's zone."""
    logp, old, adv, mask = make_batch(B=10, T=12, seed=5, spread=0.6, dtype=torch.float32)
    return logp.detach(), old, adv[:, 0].contiguous(), mask  # one advantage per response


def _tiny_path(cfg, batch, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """As experiments/tiny/train.py's update adds a minibatch (and the batched trainer, with the gradient given)."""
    logp, old, adv, mask = batch
    lp = logp.clone().requires_grad_()
    loss_tok, _ = nsr.policy_loss(lp, old, adv, mask, cfg, generator=gen)
    single = PremiseMeter(cfg)
    single.add(loss_tok, lp, adv, mask, ratio=token_ratio(lp, old))
    (grad,) = torch.autograd.grad(loss_tok.sum(), lp, retain_graph=True)
    batched = PremiseMeter(cfg, device="cpu")
    batched.add(loss_tok.detach(), lp.detach(), adv, mask, ratio=token_ratio(lp, old), grad=grad)
    assert torch.equal(single.counts(), batched.counts())
    return single.counts(), single.tokens


def _trl_path(cfg, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """NSRGRPOTrainer._compute_loss on one training micro-batch whose policy log-probs are the batch's (the model's
    forward replaced by the tensors); the trainer's own meter."""
    import trl_tiny
    from trl import GRPOConfig

    from nsr.trl import NSRGRPOTrainer

    logp, old, adv, mask = batch
    B, T = logp.shape
    args = GRPOConfig(
        output_dir="/nonexistent-not-written", use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
        per_device_train_batch_size=B, num_generations=2, max_completion_length=T, logging_steps=1, max_steps=1,
        save_strategy="no", epsilon=cfg.eps_low, epsilon_high=cfg.eps_high, loss_type="dapo", num_iterations=2,
    )  # fmt: skip
    trainer = NSRGRPOTrainer(
        model=trl_tiny.dense_lm(), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=trl_tiny.zen()["train"], processing_class=trl_tiny.char_tokenizer(), loss=cfg,
    )  # fmt: skip
    lp = logp.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, torch.zeros_like(lp), None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(),
        "old_per_token_logps": old, "advantages": adv, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    trainer._compute_loss(trainer.model, inputs).backward()
    return trainer.premise.counts(), trainer.premise.tokens


def _openrlhf_path(cfg, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """NSRPolicyLoss.forward on one micro-batch of RL step 1 (advantages per token, as OpenRLHF passes them), and the
    status scalars the actor turns its meter into, read back as the controller does."""
    from nsr.openrlhf.loss import NSRPolicyLoss
    from nsr.openrlhf.metrics import premise_logs, premise_row_from_logs
    from nsr.openrlhf.settings import NSRSettings

    logp, old, adv, mask = batch
    settings = NSRSettings.make(rule=cfg.rule, delta=cfg.delta, executor=cfg.executor)
    fn = NSRPolicyLoss(cfg.eps_low, cfg.eps_high, cfg.dual_clip, settings=settings, seed=0, rank=0)
    fn.start_step(1)
    lp = logp.clone().requires_grad_()
    loss = fn(lp, old, adv[:, None].expand_as(lp) * mask, action_mask=mask.long())[0]
    loss.backward()
    counts, tokens, tokens_adv = fn.premise.counts(), fn.premise.tokens, fn.premise.tokens_adv
    logs = premise_logs(counts.tolist(), tokens.item(), tokens_adv.item())
    assert premise_row_from_logs(1, logs, fn.cfg) == counts_row(counts, 1, cfg, tokens, tokens_adv)
    return counts, tokens


def _verl_rates(cfg, batch) -> dict[str, float]:
    """verl's registered loss function ``nsr:<rule>`` (looked up through verl) on one micro-batch: its premise
    metrics."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    import nsr.verl

    logp, old, adv, mask = batch
    nsr.verl.plugin._GENERATORS.clear()
    pl = nsr.verl.NSRPolicyLossConfig(loss_mode=f"nsr:{cfg.rule}", delta=cfg.delta, executor=cfg.executor, seed=0)
    actor = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=cfg.eps_low,
        clip_ratio_high=cfg.eps_high, policy_loss=pl,
    )  # fmt: skip
    lp = logp.clone().requires_grad_()
    fn = core_algos.get_policy_loss_fn(f"nsr:{cfg.rule}")
    _, met = fn(old_log_prob=old, log_prob=lp, advantages=adv[:, None].expand_as(lp) * mask, response_mask=mask,
                loss_agg_mode="token-mean", config=actor)  # fmt: skip
    rates_only = {
        k: v for k, v in met.items() if not k.startswith("actor/premise/n_")
    }  # the counts: tests/test_verl.py
    return {k.removeprefix("actor/premise/"): float(v) for k, v in rates_only.items() if k.startswith("actor/premise/")}


@pytest.mark.parametrize("rule", ["soft", "nsr", "hard"])
def test_every_backend_path_gives_the_same_numbers(rule):
    """The same tensors through the tiny trainer's update, TRL's loss hook (NSRGRPOTrainer._compute_loss), OpenRLHF's
    NSRPolicyLoss and verl's loss function: the same counts (verl: the same per-token rates). ``nsr`` draws its z
    from each backend's own stream, so the tiny path gets that stream (nsr.seeds) for each comparison; ``soft`` and
    ``hard`` draw nothing, so one tiny reading serves all."""
    pytest.importorskip("trl")
    pytest.importorskip("verl")
    from nsr.seeds import derive_seed, generator

    cfg = nsr.LossConfig(rule=rule, delta=0.2, dual_clip=3.0)  # verl's default dual clip, on in every path
    batch = _backend_batch()
    streams = {
        "trl": generator("trl-loss", 0, 0, 0, 0),
        "openrlhf": torch.Generator().manual_seed(derive_seed("loss", 0, 0, 1, 0)),
        "verl": generator("verl-loss", 0, 0),
    }
    want = {name: _tiny_path(cfg, batch, g) for name, g in streams.items()}
    got_trl, got_orl = _trl_path(cfg, batch), _openrlhf_path(cfg, batch)
    for name, got in (("trl", got_trl), ("openrlhf", got_orl)):
        assert torch.equal(got[0], want[name][0]), name
        assert got[1].item() == want[name][1].item() == batch[3].sum().item(), name
    ref = {k: v.item() for k, v in rates(*want["verl"]).items()}
    verl = _verl_rates(cfg, batch)
    assert verl == pytest.approx(ref, rel=1e-12, abs=0.0)
    counts = want["trl"][0]
    assert counts[:, 0, :N_BINS].sum() > 0 and counts[:, 0, N_BINS].sum() > 0  # clipped in the zone and deeper
    if rule == "hard":
        assert counts[:, 1].sum() == 0
    else:  # rescued in the zone; deeper, no weight (soft's float32 formula leaves ~1e-7 on a few deep tokens)
        assert counts[:, 1, :N_BINS].sum() > 0 and counts[:, 2, N_BINS].abs().sum() < 1e-6
        assert rule != "nsr" or counts[:, 1, N_BINS].sum() == 0
    if rule == "soft":  # no draw: every path read the same numbers
        assert all(torch.equal(w[0], counts) for w in want.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_add_never_waits_for_the_host():
    """On a GPU, three updates' worth of nsr.policy_loss + PremiseMeter.add under CUDA's sync debug mode set to
    error (any host-device sync raises); the counts equal the CPU meter's on the same ratios and gradients (weights
    to rounding: the device sums in another order)."""
    cfg = nsr.LossConfig(rule="nsr", delta=0.2)
    logp, old, adv, mask = make_batch(B=64, T=512, spread=0.6, dtype=torch.float32)
    dev = torch.device("cuda")
    old_d, adv_d, mask_d = old.to(dev), adv.to(dev), mask.to(dev)
    meter, want = PremiseMeter(cfg, device=dev), torch.zeros(2, 3, N_BINS + 1, dtype=torch.float64)
    g = torch.Generator(device=dev).manual_seed(0)
    torch.cuda.synchronize()
    for k in range(3):
        lp = (logp.detach().to(dev) * (1 + 0.02 * k)).requires_grad_()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss, _ = nsr.policy_loss(lp, old_d, adv_d, mask_d, cfg, generator=g)
            meter.add(loss, lp, adv_d, mask_d, old_log_probs=old_d)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        (grad,) = torch.autograd.grad(loss.sum(), lp)
        want += premise_counts(grad.cpu(), token_ratio(lp, old_d).cpu(), adv, mask, cfg)
    got = meter.counts().cpu()
    assert meter.counts().device.type == "cuda" and meter.tokens.item() == 3 * mask.sum().item()
    assert torch.equal(got[:, :2], want[:, :2]) and got[:, 1].sum() > 0
    torch.testing.assert_close(got[:, 2], want[:, 2], rtol=1e-12, atol=1e-9)
