"""NSRGRPOTrainer's exact savings (nsr/trl/logprobs.py, skip_zero_advantage) against the computation they replace,
on tiny local models (tests/trl_tiny.py) and a tiny Llama (SmolLM2's class), no hub.

* compact log-probs: bit-identical to TRL's ``_get_per_token_logps_and_entropies``; gradients to float32 rounding;
* shared prompt: log-probs and gradients equal to TRL's to float32 rounding (rtol 1e-5, atol 1e-6), left-padded
  prompts of several lengths and right-padded completions included;
* skip_zero_advantage: for every rule inert at A = 0, one RL step (two minibatch updates) with and without the skip
  ends at the same parameters to float32 rounding (rtol 1e-5, atol 1e-5 = 2e-4 x lr), with equal premise-meter
  counts and clip fractions, while the skip's passes really see fewer rows; a step whose every group has equal
  rewards still moves the weights through AdamW's moments as without the skip;
* checkpoint_mlp: one RL step with the MLPs recomputed in the backward ends at bit-identical parameters, with fewer
  bytes kept for the backward;
* the refusals of what would not be exact.
"""

import pytest
import torch

pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")

import trl_tiny  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import nsr  # noqa: E402
from experiments.config import ConfigError, load_config  # noqa: E402
from experiments.rundir import REPO_ROOT  # noqa: E402
from nsr.objectives import zero_at_zero_advantage  # noqa: E402
from nsr.trl import NSRGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow  # make test-fast skips it (TRL trainers)

RTOL, ATOL = 1e-5, 1e-6
"""Float32 rounding of a whole forward / backward: the shared prompt's attention sums its terms in another order."""
STEP_RTOL, STEP_ATOL = 1e-5, 1e-5
"""Parameters after one RL step (two AdamW updates at lr 0.05) with and without the skip: float32 rounding of the
gradients, through AdamW's normalisation g / (sqrt(v) + eps), which maps a rounding-level change of a gradient
element near eps (1e-8) to a change of up to about 2e-4 x lr in its parameter (measured: 1.3e-6)."""
SKIPPABLE = [r for r in nsr.RULES if zero_at_zero_advantage(r)]


def llama_lm(seed: int = 0):
    """A LlamaForCausalLM (SmolLM2-135M's class) with two layers of width 16, tied embeddings as SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**trl_tiny._common(seed), intermediate_size=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    with trl_tiny.one_thread_frozen_gc():
        paths = trl_tiny.save_models(tmp_path_factory.mktemp("trl-fast-models"))
        path = tmp_path_factory.mktemp("trl-fast-llama") / "llama"
        llama_lm().save_pretrained(path)
        trl_tiny.char_tokenizer().save_pretrained(path)
        paths["llama"] = str(path)
        yield paths


def grpo_args(tmp_path, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
        learning_rate=0.05, per_device_train_batch_size=8, steps_per_generation=2, num_generations=4,
        max_completion_length=8, logging_steps=2, max_steps=2, save_strategy="no", temperature=0.9,
        epsilon_high=0.2, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    return GRPOConfig(**(base | kw))


def mixed_reward(prompts, completions, **kw):
    """Groups of every other prompt all 0 (zero advantage); the others scored by a completion's first character."""
    out = []
    for p, c in zip(prompts, completions):
        text = p if isinstance(p, str) else p[-1]["content"]
        out.append(0.0 if len(text) % 2 else float(ord((c or " ")[0]) % 2))
    return out


def trainer(models, tmp_path, policy="llama", rule="hard", reward=mixed_reward, n_train=8, **kw):
    keys = ("compact_logprobs", "share_prompt", "skip_zero_advantage", "rollout_bf16", "allow_on_policy")
    keys += ("checkpoint_mlp",)
    options = {k: kw.pop(k) for k in keys if k in kw}
    args = grpo_args(tmp_path, **kw)
    loss = nsr.LossConfig(rule=rule, eps_low=args.epsilon, eps_high=args.epsilon_high)
    return NSRGRPOTrainer(model=models[policy], reward_funcs=reward, args=args, loss=loss, seed=0,
                          train_dataset=trl_tiny.zen(n_train=n_train)["train"], **options)  # fmt: skip


def padded_batch(tok, groups=3, g=3):
    """(input_ids, attention_mask, n_completion) in TRL's layout: prompts of different lengths, left-padded, each
    repeated g times; completions of different lengths, right-padded."""
    gen = torch.Generator().manual_seed(0)
    prompts = [tok.encode(trl_tiny.zen_lines()[i][: 9 + 4 * i]) for i in range(groups)]
    p = max(map(len, prompts))
    rows, masks = [], []
    for i, ids in enumerate(prompts):
        for j in range(g):
            n = 3 + (i + j) % 5
            comp = torch.randint(0, trl_tiny.VOCAB - 1, (n,), generator=gen).tolist()
            pad = tok.pad_token_id
            rows.append([pad] * (p - len(ids)) + ids + comp + [pad] * (8 - n))
            masks.append([0] * (p - len(ids)) + [1] * (len(ids) + n) + [0] * (8 - n))
    return torch.tensor(rows), torch.tensor(masks), 8


@pytest.mark.parametrize(("policy", "bf16"), [("llama", False), ("dense", False), ("llama", True)])
def test_compact_and_shared_logprobs_match_trls(models, tmp_path, policy, bf16):
    """The trainer's log-prob pass with each option against TRL's own on one batch (under TRL's autocast when the
    GRPOConfig asks for bf16)."""
    ids, mask, c = padded_batch(trl_tiny.char_tokenizer())
    valid = mask[:, -c:].bool()
    got = {}
    for name, options in (("trl", {}), ("compact", {"compact_logprobs": True}), ("shared", {"share_prompt": True})):
        t = trainer(models, tmp_path / name, policy=policy, bf16=bf16, **options)
        compute = (
            GRPOTrainer._get_per_token_logps_and_entropies if name == "trl" else t._get_per_token_logps_and_entropies
        )
        lp, ent, _ = (
            compute(t, t.model, ids, mask, c, compute_entropy=True)
            if name == "trl"
            else compute(t.model, ids, mask, c, compute_entropy=True)
        )
        (lp * valid).sum().backward()
        got[name] = (lp.detach(), ent.detach(), [p.grad.clone() for p in t.model.parameters()])
    ref = got["trl"]
    assert torch.equal(got["compact"][0], ref[0]) and torch.equal(got["compact"][1], ref[1])
    tol = {"rtol": RTOL, "atol": ATOL} if not bf16 else {"rtol": 1e-2, "atol": 1e-2}
    for name in ("compact", "shared"):
        lp, ent, grads = got[name]
        torch.testing.assert_close(lp, ref[0], **tol)
        torch.testing.assert_close(ent, ref[1], **tol)
        for a, b in zip(grads, ref[2], strict=True):
            torch.testing.assert_close(a, b, **tol)
    assert (ref[0][~valid] == 0).all() and (got["shared"][0][~valid] == 0).all()


def test_the_trainer_routes_its_passes_through_the_compact_path(models, tmp_path, monkeypatch):
    """With compact_logprobs the rollout's old-log-prob pass and every update read nsr.trl.logprobs, TRL's fused
    head never; without it, TRL's."""
    import nsr.trl.trainer as trainer_module

    real = trainer_module.completion_logps
    for compact in (False, True):
        calls = []

        def counted(*a, calls=calls, **k):
            calls.append(1)
            return real(*a, **k)

        monkeypatch.setattr(trainer_module, "completion_logps", counted)
        t = trainer(models, tmp_path / str(compact), compact_logprobs=compact)
        t.train()
        assert len(calls) == (4 if compact else 0)  # the old-log-prob pass of each of the 2 micro-batches, 2 updates


def rows_seen(t):
    """Wrap the trainer's log-prob pass to record how many rows each call computes."""
    seen = []
    real = t._get_per_token_logps_and_entropies

    def wrapped(model, input_ids, *a, **k):
        out = real(model, input_ids, *a, **k)
        if t._deferred_old is None:  # a pass that computes (not the deferred placeholder)
            seen.append(len(input_ids))
        return out

    t._get_per_token_logps_and_entropies = wrapped
    return seen


class Logs(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.rows.append(dict(logs or {}))


class Snapshot(TrainerCallback):
    """The parameters at the end of optimizer step ``at``."""

    def __init__(self, model, at: int, seen=()):
        self.model, self.at, self.params, self.seen, self.n_seen = model, at, {}, seen, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            self.n_seen = len(self.seen)


def run_step(models, tmp_path, rule, skip, **kw):
    t = trainer(models, tmp_path, rule=rule, skip_zero_advantage=skip, share_prompt=True, **kw)
    seen, logs = rows_seen(t), Logs()
    t.add_callback(logs)
    t.train()
    return t, seen, logs.rows


@pytest.mark.parametrize("rule", SKIPPABLE)
def test_skip_zero_advantage_one_rl_step_is_exact(models, tmp_path, rule):
    with trl_tiny.one_thread_frozen_gc():
        full, seen_full, logs_full = run_step(models, tmp_path / "full", rule, skip=False)
        skip, seen_skip, logs_skip = run_step(models, tmp_path / "skip", rule, skip=True)
    mixed = logs_full[0]["nsr/mixed_group_frac"]
    assert 0 < mixed < 1  # the batch has both kinds of groups
    assert sum(seen_skip) < sum(seen_full)  # the skip computed fewer rows
    for (name, a), b in zip(skip.model.named_parameters(), full.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=STEP_RTOL, atol=STEP_ATOL, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(skip.premise_counts, full.premise_counts)
    for key in ("nsr/clip_frac_low", "nsr/clip_frac_high", "nsr/rescue_frac", "nsr/pushout_frac", "premise/"):
        for k in [k for k in logs_full[0] if k.startswith(key)]:
            assert logs_skip[0][k] == pytest.approx(logs_full[0][k], abs=1e-12), k


def test_a_step_without_signal_still_moves_adams_moments(models, tmp_path):
    """Step 1 has mixed groups, step 2 none: with the skip, step 2's updates backpropagate exact zeros, so AdamW's
    moments from step 1 move the weights as without the skip (a skipped update that left the gradients unset would
    not move them)."""

    def reward_then_none():
        calls = []

        def reward(prompts, completions, **kw):
            calls.append(1)
            return mixed_reward(prompts, completions) if len(calls) == 1 else [1.0] * len(prompts)

        return reward

    with trl_tiny.one_thread_frozen_gc():
        out = []
        for skip in (False, True):
            t = trainer(models, tmp_path / str(skip), reward=reward_then_none(), skip_zero_advantage=skip,
                        max_steps=4)  # fmt: skip
            seen = rows_seen(t)
            first = Snapshot(t.model, at=2, seen=seen)
            t.add_callback(first)
            t.train()
            out.append((t, seen, first))
    (full, seen_full, _), (skip, seen_skip, first) = out
    first_skip = first.params
    assert len(seen_full) == 6  # per RL step TRL's old-log-prob pass and 2 updates
    assert 0 < first.n_seen == len(seen_skip)  # with the skip, RL step 2 computed no row at all
    for (name, a), b in zip(skip.model.named_parameters(), full.model.parameters(), strict=True):
        assert not torch.equal(a, first_skip[name])  # step 2 moved it
        torch.testing.assert_close(a, b, rtol=STEP_RTOL, atol=STEP_ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"rule": "kl_cov"}, "loss.rule='kl_cov'"),
        ({"rule": "clip_cov"}, "loss.rule='clip_cov'"),
        ({"beta": 0.1}, "GRPOConfig.beta=0.1"),
        ({"entropy_coef": 0.01}, "GRPOConfig.entropy_coef=0.01"),
    ],
)
def test_skip_is_refused_where_it_would_not_be_exact(models, tmp_path, kw, says):
    with pytest.raises(ValueError, match=f"skip_zero_advantage=True is not valid with {says}"):
        trainer(models, tmp_path, skip_zero_advantage=True, **kw)


def test_shared_prompt_is_refused_with_gradient_checkpointing(models, tmp_path):
    with pytest.raises(ValueError, match="share_prompt=True is not valid with GRPOConfig.gradient_checkpointing"):
        trainer(models, tmp_path, share_prompt=True, gradient_checkpointing=True)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["loss.rule=kl_cov"], "loss.rule='kl_cov'"),
        (["train.kl_coef=0.1"], "train.kl_coef=0.1"),
        (["train.entropy_coef=0.01"], "train.entropy_coef=0.01"),
    ],
)
def test_the_config_refuses_the_skip_where_it_would_not_be_exact(overrides, field):
    preset = REPO_ROOT / "sweeps" / "presets" / "smollm2-trl-cpu.yaml"
    with pytest.raises(ConfigError, match=f"{field} is not valid; allowed: .*trl.skip_zero_adv=false"):
        load_config(preset, ["trl.skip_zero_adv=true", *overrides])
    load_config(preset, ["trl.skip_zero_adv=false", *overrides])  # without the skip it runs


class DtypeOfLogits:
    """A forward hook on the LM head: the dtype of every logits tensor it returns (only generation calls the head as
    a module; the compact passes read its weight)."""

    def __init__(self, model):
        self.dtypes = []
        model.get_output_embeddings().register_forward_hook(lambda m, i, out: self.dtypes.append(out.dtype))


def first_rollout(t):
    """The buffered minibatches of the first rollout, cloned at after_rollout (before any update), and the old
    log-probs the learner computes for them there in float32 through TRL's own pass."""
    got = {}

    def hook(trainer):
        if got:
            return
        got["batches"] = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()}
                          for b in trainer._buffered_inputs]  # fmt: skip
        got["fp32"] = []
        with torch.no_grad():
            for b in got["batches"]:
                ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
                mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
                lp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask,
                                                                          b["completion_ids"].size(1))  # fmt: skip
                got["fp32"].append(lp)

    t.after_rollout = hook
    return got


@pytest.mark.parametrize("schedule", ["stale", "one_update"])
def test_bf16_rollouts_leave_the_old_logprobs_the_learners(models, tmp_path, schedule):
    """rollout_bf16: the rollout is generated under bfloat16 autocast (the LM head returns bfloat16 logits), and the
    old log-probs every update reads are the float32 learner's: recomputed before the first update (two updates per
    rollout), or the learner's own at ratio 1 (one update per rollout: every ratio logged is exactly 1)."""
    kw = {"steps_per_generation": 1, "allow_on_policy": True} if schedule == "one_update" else {}
    with trl_tiny.one_thread_frozen_gc():
        t = trainer(models, tmp_path, rollout_bf16=True, share_prompt=True, **kw)
        dtypes, rollout, logs = DtypeOfLogits(t.model), first_rollout(t), Logs()
        t.add_callback(logs)
        t.train()
    assert dtypes.dtypes and set(dtypes.dtypes) == {torch.bfloat16}  # generation ran in bfloat16
    if schedule == "stale":
        for b, fp32 in zip(rollout["batches"], rollout["fp32"], strict=True):
            valid = b["completion_mask"].bool()
            assert b["old_per_token_logps"].dtype == torch.float32
            torch.testing.assert_close(b["old_per_token_logps"][valid], fp32[valid], rtol=RTOL, atol=ATOL)
    else:
        assert all("old_per_token_logps" not in b or b["old_per_token_logps"] is None for b in rollout["batches"])
        row = next(r for r in logs.rows if "nsr/ratio_max" in r)
        assert row["nsr/ratio_min"] == row["nsr/ratio_max"] == 1.0


def test_shared_prefill_draws_the_same_samples(models, tmp_path):
    """share_prompt in generation (each prompt's prefill once): the first rollout's completions equal those of
    transformers' own generate on the same seed."""
    completions = []
    for share in (False, True):
        with trl_tiny.one_thread_frozen_gc():
            t = trainer(models, tmp_path / str(share), share_prompt=share, max_steps=1, steps_per_generation=1,
                        allow_on_policy=True)  # fmt: skip
            rollout = first_rollout(t)
            t.train()
        completions.append(torch.cat([b["completion_ids"] for b in rollout["batches"]]))
    assert torch.equal(completions[0], completions[1])


class SavedBytes:
    """The bytes of every tensor autograd keeps for a backward while the context is open (outermost hooks: a
    checkpointed block's own hooks replace them inside it, so its kept input is what counts)."""

    def __init__(self):
        self.total = 0

    def pack(self, t):
        self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


@pytest.mark.parametrize("shared", [False, True])
def test_checkpoint_mlp_is_bit_identical_and_keeps_less(models, tmp_path, shared):
    out = {}
    with trl_tiny.one_thread_frozen_gc():
        for ckpt in (False, True):
            t = trainer(models, tmp_path / str(ckpt), rule="nsr", checkpoint_mlp=ckpt, share_prompt=shared,
                        skip_zero_advantage=shared)  # fmt: skip
            kinds = {type(m).__name__ for m in t.model.modules() if m.__class__.__name__.endswith("MLP")}
            assert kinds == ({"CheckpointedLlamaMLP"} if ckpt else {"LlamaMLP"})
            with SavedBytes() as saved:
                t.train()
            out[ckpt] = (t, saved.total)
    (full, kept_full), (ckpt, kept_ckpt) = out[False], out[True]
    assert 0 < kept_ckpt < kept_full
    names = [n for n, _ in full.model.named_parameters()]
    assert names == [n for n, _ in ckpt.model.named_parameters()]  # the same parameter names (checkpoints load)
    for (name, a), b in zip(ckpt.model.named_parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_mlp_is_refused_with_gradient_checkpointing(models, tmp_path):
    with pytest.raises(ValueError, match="checkpoint_mlp=True is not valid with GRPOConfig.gradient_checkpointing"):
        trainer(models, tmp_path, checkpoint_mlp=True, gradient_checkpointing=True)
    preset = REPO_ROOT / "sweeps" / "presets" / "smollm2-trl-cpu.yaml"
    with pytest.raises(ConfigError, match="trl.gradient_checkpointing=True is not valid; allowed: false with "
                                          "trl.checkpoint_mlp=true"):  # fmt: skip
        load_config(preset, ["trl.checkpoint_mlp=true", "trl.share_prompt=false", "trl.gradient_checkpointing=true"])
