"""A rollout built by hand, for running OpenRLHF's learner without vLLM: one ``Experience`` per sample, as OpenRLHF
0.11.2's SamplesGenerator makes them (left-padded and split later by the controller), and the controller's
``RemoteExperienceMaker`` with only what its split and advantage methods read. Used by the CPU actor profiler
(experiments/openrlhf/profile_actor.py) and the real-step test harness (tests/fixtures/openrlhf/real_step.py)."""

from __future__ import annotations


def sample(seq, prompt_len: int, prompt: str, label: str, reward: float):
    """The ``Experience`` of one sample: ``seq`` (1-D token ids, prompt then response), the first ``prompt_len`` of
    them the prompt; reward and score ``reward``; nothing truncated."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    action_mask = torch.zeros(len(seq) - 1, dtype=torch.long)
    action_mask[prompt_len - 1 :] = 1
    return Experience(
        sequences=seq.unsqueeze(0),
        attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        action_mask=action_mask.unsqueeze(0),
        prompts=[prompt],
        labels=[label],
        rewards=torch.tensor([reward]),
        scores=torch.tensor([reward]),
        response_length=torch.tensor([len(seq) - prompt_len]),
        truncated=torch.tensor([False]),
        total_length=torch.tensor([float(len(seq))]),
        info={"reward": torch.tensor([reward]), "response_clip_ratio": torch.tensor([False])},
    )


def experience_maker(strategy, args, tokenizer):
    """OpenRLHF's ``RemoteExperienceMaker`` without its engines (``split_rollout_samples`` and
    ``compute_advantages_and_returns`` read only these attributes), with a zero KL controller."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    maker = object.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.tokenizer = strategy, args, tokenizer
    maker.advantage_estimator, maker.kl_ctl = args.algo.advantage.estimator, FixedKLController(0.0)
    return maker
