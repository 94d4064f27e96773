"""The testbed's Countdown / add tasks as TRL wants them: a prompt dataset and a reward function."""

from __future__ import annotations

from experiments.tasks.countdown import Task, decode


def train_dataset(task: Task):
    """The task's training split as a datasets.Dataset with columns prompt (text) and problem_id."""
    from datasets import Dataset

    ids = task.train_ids.tolist()
    return Dataset.from_dict({"prompt": [task.prompt_text(i) for i in ids], "problem_id": ids})


def task_reward(task: Task):
    """TRL reward function: 1.0 if the completion (tokens up to its EOS) solves the problem, else 0.0 (the
    testbed's exact verifier on the same token ids)."""

    def reward(prompts, completions, completion_ids, problem_id, **kwargs) -> list[float]:
        return [float(task.is_correct(int(p), decode(ids))) for p, ids in zip(problem_id, completion_ids)]

    reward.__name__ = f"{task.name}_correct"
    return reward
