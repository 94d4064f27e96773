"""The tiny testbed's tasks: exact verifiers on hand cases, the problem sets, the held-out split."""

import pytest
import torch

from experiments.models.tiny import response_mask
from experiments.tasks.countdown import EOS, TASKS, countdown_value, decode, encode, get_task


def _pid(task, prompt: str) -> int:
    ids = [i for i in range(task.n_problems) if task.prompt_text(i) == prompt]
    assert len(ids) == 1, prompt
    return ids[0]


@pytest.mark.parametrize(
    "expr, value",
    [("1+2*3", 7), ("2*3+1", 7), ("9-2*4", 1), ("9*9*9", 729), ("5-5+3", 3), ("8-3-2", 3), ("2*3-9", -3)],
)
def test_countdown_value_uses_precedence_and_left_associativity(expr, value):
    assert countdown_value(expr) == value


@pytest.mark.parametrize(
    "prompt, answer, ok",
    [
        ("123:007=", "1+2*3", True),
        ("123:007=", "3*2+1", True),  # any order of the digits
        ("123:007=", "2*3+1", True),
        ("123:007=", "1+3*2", True),
        ("123:007=", "1+2+3", False),  # right digits, wrong value (6)
        ("123:007=", "(1+2)*3", False),  # no parentheses in the grammar
        ("123:007=", "3*3-2", False),  # 7, but not the prompt's digits
        ("123:007=", "7", False),  # must use all three digits
        ("123:006=", "1*2*3", True),
        ("123:006=", "2*2+2", False),  # value 6 but the wrong digits
        ("123:006=", "1+2+3 ", False),  # trailing junk
        ("123:006=", "", False),
        ("123:006=", None, False),  # no EOS generated
        ("999:729=", "9*9*9", True),
        ("589:053=", "8+5*9", True),
        ("589:053=", "9*5+8", True),
        ("589:053=", "8*5+9", False),  # 49
        ("589:053=", "8+5*9=", False),  # six characters
    ],
)
def test_countdown_verifier_hand_cases(prompt, answer, ok):
    task = get_task("countdown3")
    assert task.is_correct(_pid(task, prompt), answer) is ok


def test_countdown_problem_set_and_split():
    task = get_task("countdown3")
    assert task.n_problems == 1418
    train, held = set(task.train_ids.tolist()), set(task.eval_ids.tolist())
    assert not train & held and len(train | held) == task.n_problems and len(held) == task.n_eval
    for pid in range(0, task.n_problems, 37):  # every stored answer verifies, and the prompt is 8 tokens
        assert len(encode(task.prompt_text(pid))) == task.prompt_len
        assert all(task.is_correct(pid, s) for s in task.solutions(pid))
    # the eval set is a seeded draw from the held-out split only
    a, b = task.eval_set(64, 1234), task.eval_set(64, 1234)
    assert torch.equal(a, b) and set(a.tolist()) <= held and len(set(a.tolist())) == 64
    assert not torch.equal(a, task.eval_set(64, 1))
    with pytest.raises(ValueError, match=r"eval\.n_prompts=513.*<= 512"):
        task.eval_set(513, 0)


def test_sft_targets_and_rewards_round_trip():
    task = get_task("countdown3")
    g = torch.Generator().manual_seed(0)
    ids = task.sample_train(200, g)
    assert set(ids.tolist()) <= set(task.train_ids.tolist())
    comps = task.sft_completions(ids, g)
    assert comps.shape == (200, task.answer_len) and (comps[:, -1] == EOS).all()
    assert task.rewards(ids, comps).tolist() == [1.0] * 200
    wrong = comps.clone()
    wrong[:, 0] = (wrong[:, 0] % 9) + 1  # another first digit: the digit multiset no longer matches
    assert task.rewards(ids, wrong).sum() < 200 * 0.2


@pytest.mark.parametrize(
    "a, b, answer, ok",
    [
        (123, 456, "9750", True),
        (999, 999, "8991", True),
        (0, 0, "0000", True),
        (0, 0, "0", False),
        (1, 2, "3000", True),
    ],
)
def test_add3_verifier_hand_cases(a, b, answer, ok):
    task = get_task("add3")
    pid = a * 1000 + b
    assert task.prompt_text(pid) == f"{a:03d}"[::-1] + "+" + f"{b:03d}"[::-1] + "="
    assert task.is_correct(pid, answer) is ok


def test_decode_and_response_mask():
    toks = encode("1+2*3") + [EOS, EOS, EOS]
    assert decode(toks) == "1+2*3" and decode(encode("12")) is None
    comps = torch.tensor([toks, encode("1+2*3+45"), [EOS] * 8])
    mask = response_mask(comps)
    assert mask.sum(-1).tolist() == [6, 8, 1]


def test_registry_lists_tasks():
    assert list(TASKS) == ["countdown3", "add3", "countdown4"]
    with pytest.raises(ValueError, match="task.name='nope'.*countdown3, add3, countdown4"):
        TASKS["nope"]


@pytest.mark.parametrize(
    "expr, value",
    [("1+2*3-4", 3), ("2*3*4+1", 25), ("9-8-7+6", 0), ("1-2*3*4", -23), ("9*9*9*9", 6561), ("5+5+5+5", 20)],
)
def test_countdown_value_hand_cases(expr, value):
    assert countdown_value(expr) == value


def test_countdown4_problems_and_verifier():
    task = get_task("countdown4")
    assert task.prompt_len == 9 and task.answer_len == 8 and len(task.eval_ids) == 512
    assert not set(task.eval_ids.tolist()) & set(task.train_ids.tolist())
    pid = next(i for i, (d, v, _) in enumerate(task.problems) if d == (1, 2, 3, 4) and v == 25)
    assert task.prompt_text(pid) == "1234:025="
    assert task.is_correct(pid, "4*3*2+1") and task.is_correct(pid, "1+2*3*4")  # any order of the four digits
    assert not task.is_correct(pid, "4*3*2+2")  # a digit not in the prompt
    assert not task.is_correct(pid, "4*6+1") and not task.is_correct(pid, None)  # not four digits / no EOS
    assert all(task.is_correct(pid, a) for a in task.solutions(pid)) and "4*3*2+1" in task.solutions(pid)
    assert task.answer("4*3*2+2") == 26 and task.answer("12") is None
    for d, v, answers in task.problems[::997]:  # every listed answer uses the digits and hits the target
        assert all(sorted(map(int, a[::2])) == list(d) and countdown_value(a) == v for a in answers)


@pytest.mark.parametrize(
    "answer, kind",
    [
        ("1+2*3", "correct"),
        ("1+2+3", "wrong_value"),  # the prompt's digits, value 6
        ("3*3-2", "wrong_digits"),  # value 7, but digits the prompt does not have (the GPPO collapse's outcome)
        ("1*1*1", "wrong_digits"),
        ("7", "malformed"),  # states no 3-digit expression
        ("1+2+3 ", "malformed"),
        ("", "malformed"),
        (None, "no_eos"),
    ],
)
def test_countdown_outcome_hand_cases(answer, kind):
    task = get_task("countdown3")
    assert task.outcome(_pid(task, "123:007="), answer) == kind


def test_add3_outcome_has_no_digit_split():
    task = get_task("add3")
    pid = 123 * 1000 + 456  # 123 + 456 = 579, written reversed: "9750"
    assert [task.outcome(pid, t) for t in ("9750", "9751", "975", None)] == [
        "correct",
        "wrong_answer",
        "malformed",
        "no_eos",
    ]
