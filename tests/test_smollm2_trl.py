"""SmolLM2-135M-Instruct on the trl backend (sweeps/presets/smollm2-trl-cpu.yaml), for real on CPU: every rule's loss
on one real-model batch, hard end to end with ratios exactly 1 at the first update of each rollout, nsr killed and
resumed, refusing other start weights. The model's cached conversion is shared with tests/test_smollm2.py.

Threads: NSR_THREADS as the caller set it, else both cores (conftest ``machine_threads``; `make test` runs one test at
a time)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import nsr  # noqa: E402
from experiments.config import load_config  # noqa: E402
from experiments.models.smollm2 import GGUF_SHA256, NAME, ModelSourceError, load  # noqa: E402
from experiments.run import run  # noqa: E402
from experiments.rundir import REPO_ROOT, RunDir, read_jsonl  # noqa: E402

PRESET = REPO_ROOT / "sweeps" / "presets" / "smollm2-trl-cpu.yaml"
SMALL = [
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "train.steps=2",
    "eval.n_prompts=2", "eval.n_samples=1", "eval.every=0", "logging.checkpoint_every=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_and_batch(machine_threads):
    """The model and one real batch: two chats of the preset's task with sampled answers (B 4, T ~ 60)."""
    from experiments.tasks.arithmetic import split

    cfg = load_config(PRESET)
    model, tok, _ = load(NAME)
    rows = split(cfg.task)["train"][:2]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        ids = model.generate(**enc, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=12, num_return_sequences=2)
    n_prompt = enc["input_ids"].shape[1]
    attn = (ids != tok.pad_token_id).long()
    attn[:, :n_prompt] = enc["attention_mask"].repeat_interleave(2, 0)
    return model, ids, attn, n_prompt


def response_logps(model, ids, attn, n_prompt):
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=ids.shape[1] - n_prompt + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def real_logps(model_and_batch):
    """SmolLM2's log-probs of its own sampled answers (with their graph), the mask, and the weights' gradient after
    one backward of nsr's loss through the whole model."""
    model, ids, attn, n_prompt = model_and_batch
    model.zero_grad(set_to_none=True)
    logps = response_logps(model, ids, attn, n_prompt)
    mask = attn[:, n_prompt:].bool()
    loss_tok, _ = nsr.policy_loss(logps, *inputs(logps), mask, nsr.LossConfig(rule="nsr"), torch.Generator())
    nsr.aggregate(loss_tok, mask, "token-mean").backward(retain_graph=True)
    return logps, mask, model.model.layers[0].mlp.down_proj.weight.grad.clone()


def inputs(logps):
    """Old log-probs shifted by a fixed pattern (ratios inside and outside the clip) and advantages of both signs."""
    shift = torch.linspace(-0.5, 0.5, logps.numel()).view_as(logps)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(logps)
    return logps.detach() + shift, adv


@pytest.mark.parametrize("rule", list(nsr.RULES))
def test_every_rule_on_a_real_model_batch(real_logps, rule):
    """nsr.policy_loss of each rule on SmolLM2's own log-probs of its sampled answers: finite, with a finite nonzero
    gradient on the log-probs, which the model's graph carries into the weights (shown once, for nsr)."""
    logps, mask, weight_grad = real_logps
    loss_tok, metrics = nsr.policy_loss(logps, *inputs(logps), mask, nsr.LossConfig(rule=rule), torch.Generator())
    loss = nsr.aggregate(loss_tok, mask, "token-mean")
    (grad,) = torch.autograd.grad(loss, logps, retain_graph=True)
    assert torch.isfinite(loss) and all(torch.isfinite(v).all() for v in metrics.values())
    assert torch.isfinite(grad).all() and grad[mask].abs().sum() > 0 and grad[~mask].abs().sum() == 0
    assert torch.isfinite(weight_grad).all() and weight_grad.abs().sum() > 0


@pytest.fixture
def ratios(monkeypatch):
    """Every update's (optimizer step, ratio min, ratio max, clip fraction, grad of the loss reaches weights) as the
    trainer logs them (NSRGRPOTrainer._compute_loss wrapped)."""
    from nsr.trl import NSRGRPOTrainer

    seen, original = [], NSRGRPOTrainer._compute_loss

    def spy(self, model, inputs):
        out = original(self, model, inputs)
        m = self._metrics["train"]
        seen.append((self.state.global_step, m["nsr/ratio_min"][-1], m["nsr/ratio_max"][-1], m["nsr/clip_frac"][-1],
                     float(inputs["advantages"].abs().sum())))  # fmt: skip
        return out

    monkeypatch.setattr(NSRGRPOTrainer, "_compute_loss", spy)
    return seen


def finished(rd: RunDir, steps: int) -> dict:
    rows = read_jsonl(rd.metrics_path)
    assert rd.state() == "done" and [r["step"] for r in rows] == list(range(1, steps + 1))
    meta = rd.read_config()["meta"]["model"]
    assert meta["gguf_sha256"] == GGUF_SHA256 and len(meta["weights_sha256"]) == 64 and meta["untied"] is False
    assert all(rows[-1][k] is not None for k in ("reward_mean", "clip_frac", "rescue_frac", "ratio_max"))
    return rows


@pytest.mark.slow
def test_hard_end_to_end_and_ratio_one_at_each_rollouts_first_update(machine_threads, tmp_path, ratios):
    """The preset (small batch), hard rule, to done. Old and new log-probs come from the same float32 model, code path
    and batch shapes: at the first update of each rollout every ratio is 1 within 1e-6 and nothing is clipped; the
    second (stale) update, after a step with nonzero advantages, has moved them."""
    # seed 2: both steps have a group of mixed rewards (seed 0's groups were all-correct or all-wrong, so no
    # advantage moved the policy; measured: mixed_group_frac 0.5 and 0.5, clip_frac 0.0078 at both steps)
    cfg = load_config(PRESET, [*SMALL, "loss.rule=hard", "logging.checkpoint_every=0", "seed=2"])
    run(cfg, tmp_path / "run", progress=False)
    rows = finished(RunDir(tmp_path / "run"), 2)
    k = cfg.train.minibatches * cfg.train.epochs
    assert len(ratios) == cfg.train.steps * k and k == 2
    for step, lo, hi, clip, _ in ratios[::k]:
        assert step % k == 0 and max(abs(lo - 1), abs(hi - 1)) <= 1e-6 and clip == 0
    moved = [max(abs(lo - 1), abs(hi - 1)) for (_, lo, hi, _, _), (*_, adv) in zip(ratios[1::k], ratios[::k]) if adv]
    assert moved and min(moved) > 1e-5 and any(r["mixed_group_frac"] > 0 for r in rows)


@pytest.mark.slow
def test_nsr_killed_resumes_and_refuses_other_weights(machine_threads, tmp_path):
    """nsr on the preset, stopped after step 1 as if killed; the folder whose recorded start weights differ is refused;
    with its own record it resumes from the step-1 checkpoint and ends done."""
    from experiments.trl.train import CHECKPOINT_DIR, MODEL_RECORD, run_trl

    cfg = load_config(PRESET, [*SMALL, "loss.rule=nsr"])
    rd = RunDir(tmp_path / "run")
    rd.write_config(cfg)
    run_trl(cfg, rd, progress=False, stop_after=1)
    record = rd.path / CHECKPOINT_DIR / MODEL_RECORD
    started = json.loads(record.read_text())
    record.write_text(json.dumps({**started, "weights_sha256": "0" * 64}))
    with pytest.raises(ModelSourceError, match="started from weights_sha256 0000000000000000"):
        run_trl(cfg, rd, progress=False)
    record.write_text(json.dumps(started))
    run(cfg, rd.path, progress=False)
    finished(rd, 2)
