"""Label-free rewards of the tiny testbed (experiments/tiny/rewards.py): the cluster vote, self-certainty, their
GDPO-style combination, and the training loop's reward hook. A few seconds on one core."""

import math

import pytest
import torch

from experiments.config import ConfigError, load_config
from experiments.models.tiny import build_model, logprobs, response_mask
from experiments.rundir import REPO_ROOT
from experiments.tasks.countdown import EOS, VOCAB_SIZE, encode, get_task
from experiments.tiny import train as tiny_train
from experiments.tiny.rewards import cluster_vote, group_normalized, self_certainty, train_rewards
from nsr.seeds import generator

pytestmark = pytest.mark.slow  # make test-fast skips it (runs, subprocesses)

SMOKE = REPO_ROOT / "sweeps" / "presets" / "tiny-smoke.yaml"
SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.minibatches=2",
    "eval.n_prompts=8",
    "sft.steps=20",
    "sft.warmup=5",
]


def _comps(texts, length=8):
    """Completion token rows: each text, EOS, EOS padding (None: no EOS at all)."""
    rows = []
    for t in texts:
        row = [encode("1+1+1")[0]] * length if t is None else (encode(t) + [EOS] * length)[:length]
        rows.append(row)
    return torch.tensor(rows)


# ---------------------------------------------------------------- the vote
def test_countdown_answer_is_the_expression_value():
    task = get_task("countdown3")
    assert task.answer("1+2*3") == 7 and task.answer("3*2+1") == 7 and task.answer("9-1*2") == 7
    assert task.answer("1+2+3") == 6 and task.answer("9-9*9") == -72
    assert task.answer("1+2") is None and task.answer("1+0*3") is None and task.answer(None) is None
    add3 = get_task("add3")
    assert add3.answer("0321") == "0321" and add3.answer("032") is None and add3.answer("03a1") is None


def test_a_group_with_a_clear_majority_gets_the_vote_reward():
    task = get_task("countdown3")
    # group 0: three different expressions worth 7 outvote one worth 6 and a malformed one
    # group 1: 9 (twice) beats 8; "3*3+0" (a 0 is no digit of the game) and no EOS state nothing
    texts = ["1+2*3", "3*2+1", "1+2+3", "9-1*2", "12", "3*3+0", "1*9*1", "2*4*1", None, "9*1*1"]
    groups = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    answers = [task.answer(t) for t in texts]
    assert answers == [7, 7, 6, 7, None, None, 9, 8, None, 9]
    assert cluster_vote(answers, groups).tolist() == [1, 1, 0, 1, 0, 0, 1, 0, 0, 1]


def test_vote_ties_go_to_the_first_answer_and_silent_groups_get_nothing():
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    assert cluster_vote([5, 3, 3, 5, None, None], groups).tolist() == [1, 0, 0, 1, 0, 0]
    assert cluster_vote([3, 5, 5, 3, 4, None], groups).tolist() == [1, 0, 0, 1, 1, 0]


def test_vote_through_train_rewards_reads_the_completions():
    task = get_task("countdown3")
    comps = _comps(["1+2*3", "3*2+1", "1+2+3", "2*3+1"])
    ids = torch.zeros(4, dtype=torch.long)
    verifier = task.rewards(ids, comps)
    cfg = load_config(SMOKE, SMALL)
    model = build_model(cfg.model, generator(0, "init"))
    prompts = task.prompts(ids)
    trained, logs = train_rewards(
        "vote", verifier, task, model, prompts, comps, response_mask(comps), torch.zeros(4, dtype=torch.long), 1.0
    )
    assert trained.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert logs["vote_reward_mean"] == 0.75
    assert logs["vote_correct_frac"] == pytest.approx((trained * verifier).mean().item())


# ---------------------------------------------------------------- self-certainty
def test_self_certainty_is_mean_kl_from_uniform_by_hand():
    task = get_task("countdown3")
    cfg = load_config(SMOKE, SMALL)
    model = build_model(cfg.model, generator(1, "init"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # a peaked, far-from-uniform policy
    ids = torch.tensor([0, 5, 9])
    prompts = task.prompts(ids)
    comps = _comps(["1+2*3", "12", None])
    mask = response_mask(comps)
    got = self_certainty(model, prompts, comps, mask, temperature=0.7)
    # by hand: KL(U || p) = sum_v (1/V) log((1/V) / p_v), p the next-token distribution at temperature 0.7
    seq = torch.cat([prompts, comps[:, :-1]], 1)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=seq).logits[:, prompts.shape[1] - 1 :].double() / 0.7, -1)
    u = 1.0 / VOCAB_SIZE
    kl = (u * torch.log(u / probs)).sum(-1)
    want = [(kl[i][mask[i]]).mean().item() for i in range(3)]
    assert got.tolist() == pytest.approx(want, rel=1e-5)
    assert mask.sum(-1).tolist() == [6, 3, 8] and min(want) > 0.5


def test_self_certainty_of_a_uniform_policy_is_zero():
    task = get_task("countdown3")
    cfg = load_config(SMOKE, SMALL)
    model = build_model(cfg.model, generator(0, "init"))
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()  # tied: zero logits everywhere, a uniform policy
    comps = _comps(["1+2*3", "12"])
    got = self_certainty(model, task.prompts(torch.tensor([0, 1])), comps, response_mask(comps), 1.0)
    assert got.abs().max().item() < 1e-6
    logp, _ = logprobs(model, task.prompts(torch.tensor([0, 1])), comps)
    assert torch.allclose(logp, torch.full_like(logp, -math.log(VOCAB_SIZE)))


# ---------------------------------------------------------------- GDPO-style sum
def test_label_free_sums_group_normalized_parts():
    task = get_task("countdown3")
    cfg = load_config(SMOKE, SMALL)
    model = build_model(cfg.model, generator(2, "init"))
    texts = ["1+2*3", "3*2+1", "1+2+3", "9-1*2", "1*9*1", "2*4*1", "9*1*1", "8*1*1"]
    comps = _comps(texts)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    ids = torch.zeros(8, dtype=torch.long)
    prompts, mask = task.prompts(ids), response_mask(comps)
    verifier = task.rewards(ids, comps)
    trained, logs = train_rewards("label_free", verifier, task, model, prompts, comps, mask, groups, 1.0)
    vote = cluster_vote([task.answer(t) for t in texts], groups)
    cert = self_certainty(model, prompts, comps, mask, 1.0)
    assert torch.allclose(trained, group_normalized(vote, groups) + group_normalized(cert, groups))
    for g in (0, 1):  # each part has mean 0 and (unbiased) std 1 within its group
        part = group_normalized(cert, groups)[groups == g]
        assert part.mean().abs() < 1e-6 and part.std().item() == pytest.approx(1.0, abs=1e-6)
    assert set(logs) == {"vote_reward_mean", "vote_correct_frac", "self_certainty_mean"}
    same, none = train_rewards("verifier", verifier, task, model, prompts, comps, mask, groups, 1.0)
    assert same is verifier and none == {}
    with pytest.raises(ValueError, match="reward.source='bogus' is not valid"):
        train_rewards("bogus", verifier, task, model, prompts, comps, mask, groups, 1.0)


# ---------------------------------------------------------------- config and loop
def test_reward_source_is_checked_and_tiny_only():
    assert load_config(SMOKE, ["reward.source=label_free"]).reward.source == "label_free"
    with pytest.raises(ConfigError, match=r"reward\.source='oracle' is not valid; allowed: verifier, vote"):
        load_config(SMOKE, ["reward.source=oracle"])
    with pytest.raises(ConfigError, match=r"reward\.source='vote' is not valid; allowed: verifier \(label-free"):
        load_config(REPO_ROOT / "sweeps" / "presets" / "qwen2.5-math-7b-dapo.yaml", ["reward.source=vote"])


def test_loop_trains_on_the_label_free_reward_and_logs_the_verifier():
    task = get_task("countdown3")
    rows = {}
    for source in ("verifier", "label_free"):
        cfg = load_config(SMOKE, SMALL + [f"reward.source={source}"])
        model = build_model(cfg.model, generator(0, "init"))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
        rows[source], _ = tiny_train.rl_step(model, opt, task, cfg, step=1)
    plain, free = rows["verifier"], rows["label_free"]
    assert free["reward_mean"] == plain["reward_mean"]  # same rollout, same verifier reward, logged alongside
    assert {"vote_reward_mean", "self_certainty_mean"} <= set(free) and "vote_reward_mean" not in plain
    # an untrained model earns no verifier reward: no signal at all; self-certainty varies in every group
    assert plain["adv_abs_mean"] == 0.0 and plain["mixed_group_frac"] == 0.0
    assert free["adv_abs_mean"] > 0.5 and free["mixed_group_frac"] == 1.0


def test_reward_source_sweep_expands_on_tiny_presets_only():
    from experiments.sweep import SweepError, expand

    runs = expand("reward_source")
    assert {r.meta["preset"] for r in runs} == {"tiny-regime"} and len(runs) == 3 * 2 * 3
    got = {(r.meta["point"]["reward"], r.config.reward.source, r.config.advantages.kind) for r in runs}
    assert got == {
        ("verifiable", "verifier", "group_norm"),
        ("label_free", "label_free", "group_norm"),
        ("random", "verifier", "random_reward"),
    }
    assert len(expand("reward_source", preset="tiny-smoke")) == 6
    with pytest.raises(SweepError, match=r"reward\.source='label_free' is not valid"):
        expand("reward_source", preset="qwen2.5-math-7b-dapo")
