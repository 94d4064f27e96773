"""SmolLM2-135M-Instruct on the trl backend (sweeps/presets/smollm2-trl-cpu.yaml), for real on CPU: every rule's loss
on one real-model batch, ratios that are not rounding noise at the first update of each rollout, hard and nsr end to
end, and a resume that refuses other weights. The model's cached conversion is shared with tests/test_smollm2.py.

Time (2 loaded cores): the rules ~1 min; each TRL run of 2 small steps 2-5 min (marked slow)."""

from __future__ import annotations

import json
import os

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
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12", "train.steps=2",
    "eval.n_prompts=2", "eval.n_samples=1", "eval.every=0", "logging.checkpoint_every=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def one_thread():
    saved, threads = os.environ.get("NSR_THREADS"), torch.get_num_threads()
    os.environ.setdefault("NSR_THREADS", "1")
    torch.set_num_threads(1)
    yield
    os.environ.pop("NSR_THREADS", None) if saved is None else os.environ.__setitem__("NSR_THREADS", saved)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_and_batch(one_thread):
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


def record_ratios(trainer):
    """Wrap the trainer's loss to record (optimizer step, ratio min, ratio max, clip fraction) of every update."""
    seen, original = [], trainer._compute_loss

    def spy(model, inputs):
        out = original(model, inputs)
        m = trainer._metrics["train"]
        seen.append((trainer.state.global_step, m["nsr/ratio_min"][-1], m["nsr/ratio_max"][-1], m["nsr/clip_frac"][-1]))
        return out

    trainer._compute_loss = spy
    return seen


@pytest.mark.slow
def test_first_update_of_each_rollout_has_ratio_one(one_thread, tmp_path):
    """Old and new log-probs come from the same float32 model, code path and batch shapes: at the first update of
    each rollout every ratio is 1 within 1e-6 and nothing is clipped; the second (stale) update moves them."""
    from experiments.trl.train import build_trainer

    cfg = load_config(PRESET, [*SMALL, "loss.rule=hard", "train.lr=1e-4"])
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    trainer, _ = build_trainer(cfg, rd)
    seen = record_ratios(trainer)
    trainer.train()
    k = cfg.train.minibatches * cfg.train.epochs
    first = [s for s in seen if s[0] % k == 0]
    assert len(first) == cfg.train.steps and len(seen) == cfg.train.steps * k
    for _, lo, hi, clip in first:
        assert max(abs(lo - 1), abs(hi - 1)) <= 1e-6 and clip == 0
    later = [s for s in seen if s[0] % k]
    assert max(max(abs(lo - 1), abs(hi - 1)) for _, lo, hi, _ in later) > 1e-4  # the stale update is off-policy


def finished(rd: RunDir, steps: int) -> dict:
    rows = read_jsonl(rd.metrics_path)
    assert rd.state() == "done" and [r["step"] for r in rows] == list(range(1, steps + 1))
    meta = rd.read_config()["meta"]["model"]
    assert meta["gguf_sha256"] == GGUF_SHA256 and len(meta["weights_sha256"]) == 64 and meta["untied"] is False
    return rows[-1]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["hard", "nsr"])
def test_end_to_end_on_the_preset(one_thread, tmp_path, rule):
    cfg = load_config(PRESET, [*SMALL, f"loss.rule={rule}", "logging.checkpoint_every=0"])
    run(cfg, tmp_path / "run", progress=False)
    row = finished(RunDir(tmp_path / "run"), 2)
    assert all(row[k] is not None for k in ("reward_mean", "clip_frac", "rescue_frac", "ratio_max"))


@pytest.mark.slow
def test_resume_refuses_other_weights(one_thread, tmp_path):
    """A run killed after step 1 resumes to done; the same folder whose recorded start weights differ is refused."""
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
    run(cfg, rd.path, progress=False)  # the recorded weights again: resumes from step 1 and finishes
    finished(rd, 2)
