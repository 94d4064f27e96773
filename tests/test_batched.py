"""The batched trainer (experiments/tiny/batched.py): S tiny runs as one model, each run today's run.

Equivalence (issue 25 item 2): (a) float32: the batched model gives the HF GPT-2's logits, per-run gradients and
sampled tokens, and one RL step matches ``rl_step`` for every run of a batch of 8; (b) float64 (the tests' switch):
every run of a batch of 8 gives the single-run trainer's sampled tokens and rows (1e-9) over 10 steps. Also: a run's
numbers do not depend on its batch (bit for bit in float32), the compatibility key and its refusals, the run-folder
contract per run through ``experiments.run --seeds`` (config, rows, evals, status, a resume after a crash), a run that
fails fails alone, and a batch checkpoint is a single-run checkpoint.

Small sizes (a 10-step warm start, 8 x 4 rollouts) keep the file near a minute on one core.
"""

import gzip
import json

import pytest
import torch
from conftest import run_environment

import experiments.tiny.batched as batched
import experiments.tiny.train as single
from experiments.config import ConfigError, load_config
from experiments.models.tiny import build_model, generate, logprobs
from experiments.run import main as run_main
from experiments.run import run_batch
from experiments.rundir import REPO_ROOT, RunDir, RunExistsError, read_jsonl
from experiments.sft import warm_start
from experiments.tasks.countdown import get_task
from experiments.tiny.batched import batch_key, batch_rl_step, check_batch, parse_seeds, seed_run_id, train_batch
from experiments.tiny.batched_model import BatchedAdamW, BatchedGPT2
from nsr.seeds import generator

pytestmark = [  # make test-fast skips it (runs)
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract"),
]
SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
BASE = [
    "sft.steps=10", "sft.warmup=5", "sft.batch_size=32", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
    "train.minibatches=2", "train.steps=10", "eval.every=5", "eval.n_prompts=16", "eval.n_samples=3",
    "logging.checkpoint_every=5", "logging.progress=false",
]  # fmt: skip
"""A 10-step warm start earns almost no verifier reward, so most runs train on coin-flip rewards (random_reward) or a
label-free reward: every run has a gradient; the verifier's reward is still computed and logged."""
MEMBERS = [  # eight runs that differ in everything a batch lets them differ in
    ["loss.rule=hard", "seed=0", "advantages.kind=random_reward"],
    ["loss.rule=nsr", "seed=1", "train.lr=1e-3", "train.grad_clip=0.5", "advantages.kind=random_reward"],
    ["loss.rule=soft", "seed=2", "sft.seed=1", "train.adam_betas=[0.8,0.95]", "train.weight_decay=0.01",
     "advantages.kind=random_reward"],
    ["loss.rule=kl_cov", "loss.kl_cov_frac=0.05", "seed=3", "train.agg_mode=seq-mean-token-mean",
     "advantages.kind=no_std", "reward.source=certainty"],
    ["loss.rule=nsr", "loss.level=sequence", "seed=4", "advantages.kind=random_reward"],
    ["loss.rule=clip_cov", "loss.clip_cov_frac=0.05", "seed=5", "train.kl_coef=0.1", "train.entropy_coef=0.01",
     "advantages.kind=random_reward"],
    ["loss.rule=gppo", "seed=6", "train.dgg=true", "train.dgg_k=1.5", "advantages.kind=random_reward"],
    ["loss.rule=cispo", "seed=7", "reward.source=vote", "advantages.noise=0.1", "advantages.noise_mode=add_all"],
]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with run_environment(tmp_path_factory, "batched-cache", NSR_WARM_STARTS="", NSR_THREADS="1"):
        yield


def config(extra=(), steps=None):
    return load_config(SMOKE, [*BASE, *extra, *([f"train.steps={steps}"] if steps else [])])


@pytest.fixture(scope="module")
def cfgs(env):
    return [config(m) for m in MEMBERS]


def _single(cfg, dtype=torch.float32):
    """A single run's model and optimizer at its warm start, as train() builds them."""
    model = build_model(cfg.model, generator(cfg.sft.seed, "sft-init"))
    model.load_state_dict(warm_start(cfg)[0])
    model.to(dtype)
    tr = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=tr.adam_betas, weight_decay=tr.weight_decay)
    gate = single.GradientGate(tr.dgg_k, tr.dgg_window) if tr.dgg else None
    ref = None
    if tr.kl_coef > 0:
        ref = build_model(cfg.model, generator(0, "ref")).to(dtype)
        ref.load_state_dict(model.state_dict())
        ref.eval().requires_grad_(False)
    return model, opt, gate, ref


def _batch(cfgs, dtype=torch.float32):
    model = BatchedGPT2(cfgs[0].model, [warm_start(c)[0] for c in cfgs], dtype)
    tr = [c.train for c in cfgs]
    opt = BatchedAdamW(model, [t.lr for t in tr], [t.adam_betas for t in tr], [t.weight_decay for t in tr])
    gates = [single.GradientGate(t.dgg_k, t.dgg_window) if t.dgg else None for t in tr]
    ref = model.detached() if any(t.kl_coef > 0 for t in tr) else None
    return model, opt, gates, ref


def _rows(rd: RunDir, name="metrics.jsonl"):
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in read_jsonl(rd.log_path(name))]


def _close(a: dict, b: dict, rel: float, abs_: float = 0.0) -> float:
    """Largest |a - b| / max(|a|, 1) over the keys (which must be the same, in the same order)."""
    assert list(a) == list(b)
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, list):
            worst = max([worst, *(abs(p - q) / max(abs(p), 1.0) for p, q in zip(x, y))])
        elif isinstance(x, (int, float)):
            worst = max(worst, abs(x - y) / max(abs(x), 1.0))
        else:
            assert x == y, k
    return worst


# ------------------------------------------------------------------ (a) float32 against the HF model
def test_batched_model_gives_the_hf_logits_gradients_and_tokens(env):
    cfg = config()
    models = [build_model(cfg.model, generator(s, "weights")) for s in range(3)]
    bm = BatchedGPT2(cfg.model, [m.state_dict() for m in models])
    task = get_task(cfg.task.name)
    pids = task.sample_train(6, generator(0, "ids"))
    prompts = task.prompts(pids).repeat_interleave(4, 0)  # 6 prompts x 4 samples, as a rollout
    comps = torch.stack([generate(m, prompts, 8, 1.0, generator(s, "draw")) for s, m in enumerate(models)])
    # sampled tokens: each member draws on its own generator what the HF model draws on it
    ours = bm.generate(bm.params, task.prompts(pids).expand(3, -1, -1), 8, 1.0,
                       [generator(s, "draw") for s in range(3)], group=4)  # fmt: skip
    assert torch.equal(ours, comps)
    # logits of every position, and log-probs + entropy through the prompt-shared path, then their gradients
    seq = torch.cat([prompts, comps[0][:, :-1]], 1)
    lg = bm.logits(bm.params, seq.expand(3, -1, -1))
    prefix = (torch.arange(24) // 4).expand(3, -1)
    lp, ent = bm.logprobs(bm.params, task.prompts(pids).expand(3, -1, -1), comps, with_entropy=True, prefix=prefix)
    (lp.sum() + ent.sum()).backward()
    for s, m in enumerate(models):
        torch.testing.assert_close(lg[s], m(input_ids=seq, use_cache=False).logits, rtol=1e-5, atol=1e-5)
        ref_lp, ref_ent = logprobs(m, prompts, comps[s], with_entropy=True)
        torch.testing.assert_close(lp[s], ref_lp, rtol=1e-5, atol=1e-5)
        (ref_lp.sum() + ref_ent.sum()).backward()
        for name, p in m.named_parameters():
            scale = p.grad.abs().max()
            torch.testing.assert_close(bm.params[name].grad[s] / scale, p.grad / scale, rtol=1e-5, atol=1e-5)
    assert torch.equal(bm.member_state(1)["lm_head.weight"], models[1].state_dict()["lm_head.weight"])


def test_one_rl_step_matches_rl_step_for_every_run_of_a_batch_of_8(cfgs):
    """float32, the same state: the rows agree to float32 rounding, and so does each run's weight update (in norm;
    AdamW moves a weight whose gradient is near 0 by up to lr per update, so one element may move by a share of
    lr where the two gradients differ in their last bits)."""
    task = get_task(cfgs[0].task.name)
    model, opt, gates, ref = _batch(cfgs)
    out = batch_rl_step(model, opt, task, cfgs, 1, list(range(8)), ref, gates)
    assert sorted(out) == list(range(8))
    for s, cfg in enumerate(cfgs):
        m, o, gate, r = _single(cfg)
        start = {n: p.detach().clone() for n, p in m.named_parameters()}
        row, bins = single.rl_step(m, o, task, cfg, 1, r, gate)
        brow, bbins = out[s]
        assert _close(row, brow, 0) < 1e-4, (s, row, brow)
        assert (bins is None) == (bbins is None) and (bins is None or _close(bins, bbins, 0) < 1e-4)
        diff = sum(((model.params[n][s].detach() - p.detach()) ** 2).sum() for n, p in m.named_parameters())
        update = sum(((p.detach() - start[n]) ** 2).sum() for n, p in m.named_parameters())
        assert (diff / update).sqrt() < 2e-3, (s, (diff / update).sqrt())
        worst = max((model.params[n][s].detach() - p.detach()).abs().max().item() for n, p in m.named_parameters())
        assert worst < 0.1 * cfg.train.lr * cfg.train.epochs * cfg.train.minibatches, (s, worst)


# ------------------------------------------------------------------ (b) float64: identical runs
def test_float64_every_run_of_a_batch_of_8_is_the_single_run(cfgs, tmp_path, monkeypatch):
    """10 steps with evals and checkpoints: the same sampled tokens, the same eval labels and bins counts, rows to
    1e-9, for every run."""
    drawn: list[torch.Tensor] = []
    real = single.generate

    def record(*a, **k):
        out = real(*a, **k)
        drawn.append(out)
        return out

    trace: dict = {}
    folders = [tmp_path / f"b{s}" for s in range(8)]
    assert train_batch(cfgs, folders, progress=False, dtype=torch.float64, trace=trace) == {}
    monkeypatch.setattr(single, "generate", record)
    worst = 0.0
    for s, cfg in enumerate(cfgs):
        drawn.clear()
        rd = RunDir(tmp_path / f"s{s}")
        rd.path.mkdir()
        single.train(cfg, rd, progress=False, dtype=torch.float64)
        rollouts = [d for d in drawn if d.shape[0] == 32]  # a rollout's 8 x 4 samples (evals draw 16 and 16 x 3)
        assert len(rollouts) == 10
        for step, comps in enumerate(rollouts, 1):
            assert torch.equal(comps, trace[(s, step)]), (s, step)
        b = RunDir(folders[s])
        for name in ("metrics.jsonl", "ratio_bins.jsonl"):
            if name == "ratio_bins.jsonl" and cfg.loss.level == "sequence":
                assert not b.log_path(name).exists()
                continue
            ours, theirs = _rows(b, name), _rows(rd, name)
            assert len(ours) == len(theirs) == 10
            for x, y in zip(ours, theirs):
                worst = max(worst, _close(y, x, 0))
                if name == "ratio_bins.jsonl":
                    assert {k: v for k, v in x.items() if "weight" not in k} == {
                        k: v for k, v in y.items() if "weight" not in k
                    }
        assert read_jsonl(b.eval_path) == read_jsonl(rd.eval_path)
        assert sorted(p.name for p in b.path.iterdir()) == sorted(p.name for p in rd.path.iterdir())
    assert worst < 1e-9, worst
    assert any("dgg_gated" in r for r in _rows(RunDir(folders[6])))  # the options ran: DGG, KL, the vote reward
    assert "ref_kl" in _rows(RunDir(folders[5]))[0] and "vote_reward_mean" in _rows(RunDir(folders[7]))[0]


def test_a_runs_numbers_do_not_depend_on_its_batch(cfgs):
    """float32, bit for bit: a run alone, or at another place in another batch, gives the same rows."""
    task = get_task(cfgs[0].task.name)
    alone = _batch([cfgs[1]])
    mixed = [cfgs[3], cfgs[0], cfgs[1]]
    batch = _batch(mixed)
    for step in (1, 2):
        a = batch_rl_step(alone[0], alone[1], task, [cfgs[1]], step, [0])[0]
        b = batch_rl_step(batch[0], batch[1], task, mixed, step, [0, 1, 2])[2]
        assert a == b


# ------------------------------------------------------------------ compatibility
def test_batch_key_and_the_fields_a_batch_refuses(cfgs):
    assert len({batch_key(c) for c in cfgs}) == 1  # seeds, sft, loss, advantages, rewards, optimizer may differ
    check_batch(cfgs)
    for field, value in [("rollout.prompts_per_step", 4), ("train.epochs", 1), ("eval.every", 2),
                         ("model.d_model", 32), ("train.steps", 3)]:  # fmt: skip
        other = config([f"{field}={value}"])
        assert batch_key(other) != batch_key(cfgs[0])
        with pytest.raises(ConfigError, match=rf"{field}=.*differs.*allowed: the same {field}"):
            check_batch([cfgs[0], other])
    with pytest.raises(ConfigError, match="run 1 is the config of run 0"):
        check_batch([cfgs[0], cfgs[0]])
    with pytest.raises(ConfigError, match="at least one"):
        check_batch([])
    cluster = load_config(REPO_ROOT / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml")
    with pytest.raises(ConfigError, match="backend='openrlhf' is not valid in a batch; allowed: tiny"):
        batch_key(cluster)
    assert parse_seeds("0-3,8") == [0, 1, 2, 3, 8] and parse_seeds("5") == [5]
    for bad in ("3-1", "a", "0,0", "-1", ""):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


# ------------------------------------------------------------------ the command line, the contract, resume
def test_seeds_cli_one_folder_per_seed_and_a_crashed_batch_resumes(env, tmp_path, monkeypatch, capsys):
    args = [str(SMOKE), *BASE, "train.steps=8", "eval.every=4", "logging.checkpoint_every=3", "loss.rule=nsr"]
    args += ["advantages.kind=random_reward"]
    out = tmp_path / "seeds"
    assert run_main([*args, "--seeds", "0-2", "--out", str(out), "--no-progress"]) == 0
    cfgs = [load_config(SMOKE, [*args[1:], f"seed={s}"]) for s in range(3)]
    folders = [out / seed_run_id("tiny-smoke", c) for c in cfgs]
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in folders)
    for cfg, f in zip(cfgs, folders):
        rd = RunDir(f)
        saved = rd.read_config()
        assert rd.state() == "done" and saved["meta"]["run_hash"] == cfg.run_hash() and saved["seed"] == cfg.seed
        assert saved["meta"]["warm_start"]["key"] and saved["meta"]["engine"] == {"trainer": "batched", "runs": 3}
        assert [r["step"] for r in _rows(rd)] == list(range(1, 9)) and not rd.checkpoint_path.exists()
        assert {r["step"] for r in read_jsonl(rd.eval_path)} == {0, 4, 8} and rd.eval_path.suffix == ".gz"
    done = [_rows(RunDir(f)) for f in folders]
    assert "done: " in capsys.readouterr().out
    assert run_main([*args, "--seeds", "0-2", "--out", str(out), "--no-progress"]) == 3  # all done: refused

    # a crash after step 5 (checkpoints at 3): every run resumes from its own checkpoint to the same rows
    again = tmp_path / "again"
    real = batched.batch_rl_step

    def crash(*a, **k):
        if a[4] == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(batched, "batch_rl_step", crash)
    with pytest.raises(KeyboardInterrupt):
        run_batch(cfgs, [again / f.name for f in folders], progress=False)
    assert all(RunDir(again / f.name).state() == "cancelled" for f in folders)
    monkeypatch.setattr(batched, "batch_rl_step", real)
    # run 2 goes on alone to step 6 first: the batch then resumes runs from different steps
    assert run_batch([cfgs[2]], [again / folders[2].name], progress=False)[0]["state"] == "done"
    statuses = run_batch(cfgs, [again / f.name for f in folders], progress=False)  # run 2 is done: skipped
    assert [s["state"] for s in statuses] == ["done"] * 3 and [s["attempts"] for s in statuses] == [2, 2, 2]
    assert [_rows(RunDir(again / f.name)) for f in folders] == done
    with pytest.raises(RunExistsError, match="every run of this batch is done"):
        run_batch(cfgs, [again / f.name for f in folders], progress=False)


def test_a_failing_run_fails_alone(env, tmp_path, monkeypatch):
    """An exception in one run's loss at step 2 and NaN weights in another: both fail alone (status failed, the
    error recorded), the others finish with the rows they have in a batch without them."""
    cfgs = [config(["loss.rule=nsr", f"seed={s}", "train.steps=4", "eval.every=0", "advantages.kind=random_reward"])
            for s in range(4)]  # fmt: skip
    clean = train_batch([cfgs[0], cfgs[3]], [tmp_path / "c0", tmp_path / "c3"], progress=False)
    assert clean == {}
    real = batched.nsr.policy_loss

    def loss(lp, old, adv, m, lcfg, generator=None):
        if generator is not None and generator.initial_seed() == batched.generator(1, 2, "loss").initial_seed():
            raise FloatingPointError("run 1 broke")
        return real(lp, old, adv, m, lcfg, generator=generator)

    monkeypatch.setattr(batched.nsr, "policy_loss", loss)
    real_step = batched.batch_rl_step

    def poison(model, *a, **k):  # run 2's weights become NaN after step 2: its next draw fails
        if a[3] == 3:
            with torch.no_grad():
                model.flat[2].fill_(float("nan"))
        return real_step(model, *a, **k)

    monkeypatch.setattr(batched, "batch_rl_step", poison)
    folders = [tmp_path / f"r{s}" for s in range(4)]
    statuses = run_batch(cfgs, folders, progress=False)
    assert [s["state"] for s in statuses] == ["done", "failed", "failed", "done"]
    assert "run 1 broke" in statuses[1]["error"] and "FloatingPointError" in statuses[1]["traceback"]
    assert "probability tensor" in statuses[2]["error"]
    assert [len(_rows(RunDir(f))) for f in folders] == [4, 1, 2, 4]
    assert _rows(RunDir(folders[0])) == _rows(RunDir(tmp_path / "c0"))
    assert _rows(RunDir(folders[3])) == _rows(RunDir(tmp_path / "c3"))
    assert run_main([str(SMOKE), "seed=1", "--seeds", "0", "--no-progress"]) == 2  # seed= and --seeds


def test_bad_nsr_threads_fails_every_run_of_the_batch_before_it_starts(tmp_path, monkeypatch):
    cfgs = [config([f"seed={s}", "train.steps=2", "eval.every=0"]) for s in range(2)]
    folders = [tmp_path / f"r{s}" for s in range(2)]
    monkeypatch.setenv("NSR_THREADS", "-1")
    with pytest.raises(ConfigError, match="NSR_THREADS='-1' is not valid; allowed: a positive integer"):
        run_batch(cfgs, folders, progress=False)
    for f in folders:
        st = RunDir(f).status()
        assert st["state"] == "failed" and "NSR_THREADS='-1'" in st["error"] and not RunDir(f).metrics_path.exists()


def test_a_batch_resumed_at_another_thread_count_notes_each_run(tmp_path, monkeypatch, capsys):
    """As experiments.run's note: every run of the batch whose earlier attempts used another NSR_THREADS is named."""
    cfgs = [config([f"seed={s}", "train.steps=2", "eval.every=0"]) for s in range(2)]
    folders = [tmp_path / f"r{s}" for s in range(2)]
    RunDir(folders[0]).set_status("running", threads=2)  # an earlier attempt of run 0 at 2 threads, cancelled
    RunDir(folders[0]).set_status("cancelled")
    monkeypatch.setenv("NSR_THREADS", "1")
    statuses = run_batch(cfgs, folders, progress=False)
    assert [s["state"] for s in statuses] == ["done", "done"] and statuses[0]["thread_counts"] == [1, 2]
    err = capsys.readouterr().err
    assert f"note: {folders[0]}: NSR_THREADS=1, its earlier attempts used 2" in err and str(folders[1]) not in err


def test_a_batch_checkpoint_is_a_single_run_checkpoint(env, tmp_path):
    """A run checkpointed by the batch resumes in the single-run trainer, and the other way round (float64: to the
    rows of a run that never changed trainer)."""
    quick = ["loss.rule=nsr", "seed=3", "eval.every=0", "advantages.kind=random_reward", "logging.keep_checkpoint=true"]
    cfg, two = config([*quick, "train.steps=4"]), config([*quick, "train.steps=2"])
    b = RunDir(tmp_path / "batch")
    assert train_batch([cfg], [b.path], progress=False, dtype=torch.float64) == {}
    ck = torch.load(b.checkpoint_path, weights_only=True)
    assert ck["step"] == 4 and ck["run_hash"] == cfg.run_hash() and ck["warm_start"] == warm_start(cfg)[1]["sha256"]
    assert set(ck["model"]) == set(build_model(cfg.model, generator(0, "x")).state_dict())

    def first_two_steps(folder, trainer):
        """Steps 1-2 of cfg by ``trainer`` (a 2-step config: the same draws), its checkpoint relabelled as cfg's."""
        rd = RunDir(tmp_path / folder)
        rd.path.mkdir()
        trainer(rd)
        state = torch.load(rd.checkpoint_path, weights_only=True)
        assert state["step"] == 2
        state["run_hash"] = cfg.run_hash()
        torch.save(state, rd.checkpoint_path)
        (rd.path / "eval.jsonl.gz").unlink()
        return rd

    s = first_two_steps("b-then-s", lambda rd: train_batch([two], [rd.path], progress=False, dtype=torch.float64))
    single.train(cfg, s, progress=False, dtype=torch.float64)
    t = first_two_steps("s-then-b", lambda rd: single.train(two, rd, progress=False, dtype=torch.float64))
    assert train_batch([cfg], [t.path], progress=False, dtype=torch.float64) == {}
    for rd in (s, t):
        assert [r["step"] for r in _rows(rd)] == [1, 2, 3, 4]
        for x, y in zip(_rows(rd), _rows(b)):
            assert _close(x, y, 0) < 1e-9
        with gzip.open(rd.path / "ratio_bins.jsonl.gz") as f:
            assert len([json.loads(line) for line in f]) == 4
