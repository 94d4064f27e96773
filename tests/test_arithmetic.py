"""The generated arithmetic task of the real model (experiments/tasks/arithmetic.py): determinism, disjoint splits,
the reward, the config checks, the files written on first use; the pass-rate spread of SmolLM2 on it
(experiments/evaluation/spread.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from experiments.config import load_config
from experiments.config_errors import ConfigError
from experiments.evaluation import spread
from experiments.tasks import arithmetic
from experiments.tasks.arithmetic import FAMILIES, GENERATOR_VERSION, problems, split

PRESET = "sweeps/presets/smollm2-trl-cpu.yaml"


@pytest.fixture(scope="module")
def cfg():
    return load_config(PRESET)


def test_every_family_is_what_it_says():
    for name, make in FAMILIES.items():
        items = make()
        assert len({t for t, _ in items}) == len(items)  # distinct problems
        for text, ans in items:
            assert eval(text) == ans, (name, text)  # noqa: S307 - our own digits and + - *
    assert {k: len(v()) for k, v in FAMILIES.items()} == {
        "add_1d": 81, "mul_1d": 64, "add_3x1d": 729, "mul_add": 576, "add_2d1d": 810, "sub_2d1d": 810,
        "add_2d2d": 8100, "mul_2d1d": 720, "mul_add_2d": 5760, "mul_sub": 576}  # fmt: skip


def test_version_1s_problems_never_move():
    """Every family's problems and order under generator version 1, pinned (sha256 of problems((family,)) as JSON):
    the committed runs' data, and what lets a new family join without a version bump."""
    pinned = {
        "add_1d": "944fbc41652a687d", "mul_1d": "1fca96685f2a8448", "add_3x1d": "e60e1d8f7062a64e",
        "mul_add": "c0acec69b0a8f868", "add_2d1d": "d6a83b4465e64d92", "sub_2d1d": "8516a69c06fde086",
    }  # fmt: skip
    digest = {f: hashlib.sha256(json.dumps(problems((f,), 1)).encode()).hexdigest()[:16] for f in pinned}
    assert digest == pinned
    mix = hashlib.sha256(json.dumps(problems(("mul_add", "add_3x1d"), 1)).encode()).hexdigest()[:16]
    assert mix == "bce1022208eaad29"  # stage D's pilot mix (results/pilot_d)


def test_problems_are_seeded_interleaved_and_versioned():
    a, b = problems(("mul_add", "add_2d1d")), problems(("mul_add", "add_2d1d"))
    assert a == b and len(a) == 576 + 810
    assert [r["problem_id"].split("-")[0] for r in a[:4]] == ["mul_add", "add_2d1d", "mul_add", "add_2d1d"]
    assert [r["problem"] for r in a[:20:2]] != [t for t, _ in FAMILIES["mul_add"]()[:10]]  # shuffled
    assert problems(("mul_add",), GENERATOR_VERSION + 1) != problems(("mul_add",))


def test_splits_are_disjoint_sized_and_the_eval_set_does_not_move(cfg):
    parts = split(cfg.task)
    train, held = ({r["problem"] for r in parts[k]} for k in ("train", "eval"))
    assert len(train) == cfg.task.n_train >= 400 and len(held) == cfg.task.n_eval and not train & held
    fewer = split(dataclasses.replace(cfg.task, n_train=100))
    assert fewer["eval"] == parts["eval"] and fewer["train"] == parts["train"][:100]


def test_the_one_shot_problem_is_in_neither_split(cfg):
    parts = split(cfg.task)
    shown = [r["problem"] for r in problems(cfg.task.families) if r["problem"] in cfg.task.one_shot[0]]
    assert shown == ["7 * 3 + 5"] and len(parts["train"]) + len(parts["eval"]) == 575
    assert all(r["problem"] != "7 * 3 + 5" for part in parts.values() for r in part)


def test_a_prompt_is_the_configured_chat(cfg):
    row = split(cfg.task)["train"][0]
    t = cfg.task
    assert t.system_prompt == "" and row["prompt"] == [  # no system turn: the model's template adds its own
        {"role": "user", "content": t.one_shot[0]},
        {"role": "assistant", "content": t.one_shot[1]},
        {"role": "user", "content": t.prompt_template.replace("{problem}", row["problem"])},
    ]
    user = t.prompt_template.replace("{problem}", "2 + 2")
    assert arithmetic.messages(dataclasses.replace(t, one_shot=()), "2 + 2") == [{"role": "user", "content": user}]
    system = arithmetic.messages(dataclasses.replace(t, system_prompt="Be brief."), "2 + 2")[0]
    assert system == {"role": "system", "content": "Be brief."}


def test_the_reward_is_the_kits_math_reward(cfg):
    reward = arithmetic.reward_func()
    completions = [[{"role": "assistant", "content": "9 * 5 = 45, and 45 + 5 = 50. The answer is \\boxed{50}."}],
                   [{"role": "assistant", "content": "The answer is \\boxed{51}."}],
                   [{"role": "assistant", "content": "50"}]]  # fmt: skip
    assert reward(prompts=[None] * 3, completions=completions, label=["50"] * 3) == [1.0, 0.0, 0.0]


def test_files_are_written_once_and_read_back(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))
    paths = arithmetic.write_files(cfg.task)
    assert paths["train"].parent.parent == tmp_path / "tasks"
    rows = arithmetic.read_rows(paths["train"])
    assert rows == split(cfg.task)["train"]
    stamp = paths["train"].stat().st_mtime_ns
    assert arithmetic.write_files(cfg.task) == paths and paths["train"].stat().st_mtime_ns == stamp
    other = dataclasses.replace(cfg.task, prompt_template="Compute {problem}.")
    assert arithmetic.data_dir(other) != arithmetic.data_dir(cfg.task)  # the template is part of the key


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.generator_version=2", r"task.generator_version=2 is not valid; allowed: 1"),
        ("task.families=[mul_add,cube]", r"task.families=.*allowed: a non-empty list of add_1d"),
        ("task.families=[]", r"task.families=\[\] is not valid"),
        ("task.n_train=5000", r"task.n_train=5000 is not valid"),
        ("task.prompt_template='What is it?'", r"task.prompt_template=.*allowed: a text containing \{problem\}"),
        ("task.one_shot=[only-the-question]", r"task.one_shot=.*allowed: \[\] or \[user turn, assistant turn\]"),
        ("task.train_data=x.jsonl", r"task.train_data='x.jsonl' is not valid; allowed: '' \(the arithmetic task"),
        ("model.name=tiny-qwen2", r"model.name='tiny-qwen2' is not valid"),
    ],
)
def test_bad_task_fields_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PRESET, [override])


def test_the_task_fields_are_part_of_the_run_identity(cfg):
    for override in ("task.prompt_template='Compute {problem}.'", "task.one_shot=[]", "task.system_prompt='Be brief.'",
                     "task.families=[mul_add,add_3x1d]", "task.n_train=400"):  # fmt: skip
        assert load_config(PRESET, [override]).run_hash() != cfg.run_hash(), override


def test_the_task_command_refuses_the_spread_naming_where_it_moved(tmp_path, capsys, monkeypatch):
    """The spread loads a model, so it left the task module (which imports no model): the task's command refuses
    ``--spread`` before any work, naming the command that measures it with the same options (the one
    results/smollm2/spread-100x16-seed0.json records ran under the task's command)."""
    monkeypatch.setenv("NSR_CACHE_DIR", str(tmp_path))
    argv = [PRESET, "--spread", "100", "16", "--json", "x.json"]
    assert arithmetic.main(argv) == 2
    err = capsys.readouterr().err
    assert f"python -m experiments.evaluation.spread {PRESET} --spread 100 16 --json x.json" in err
    assert not any(tmp_path.iterdir())  # nothing written
    assert arithmetic.main([PRESET]) == 0 and "train" in capsys.readouterr().out  # the task files, as before


@pytest.mark.slow
def test_the_spread_of_smollm2_on_a_fixed_set(machine_threads, tmp_path, capsys):
    """``python -m experiments.evaluation.spread PRESET --spread 8 4`` on the SmolLM2 preset (the model's cached
    conversion, transformers' generate, seed 0): the per-prompt pass rates, their summary and the result file with its
    command. The full measurement (100 x 16) is in docs/testbed.md."""
    pytest.importorskip("gguf", reason="the SmolLM2 conversion needs gguf (make venv)")
    out = tmp_path / "spread.json"
    assert spread.main(["sweeps/presets/smollm2-trl-cpu.yaml", "--spread", "8", "4", "--json", str(out)]) == 0
    assert "| mul_add | 8 |" in capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["command"].startswith("python -m experiments.evaluation.spread ")
    assert got["command"].endswith(f"--spread 8 4 --json {out}") and len(got["load_average"]) == 3
    rates = [r["pass"] for r in got["rows"]]
    assert len(rates) == 8 and {r["family"] for r in got["rows"]} == {"mul_add"}
    assert all(x in (0, 0.25, 0.5, 0.75, 1) for x in rates)  # 4 samples each
    assert got["all"]["mean"] == pytest.approx(sum(rates) / 8)
    assert got["all"]["band"] == pytest.approx(sum(0.1 <= x <= 0.9 for x in rates) / 8)
    assert got["families"]["mul_add"] == got["all"]
    assert got["all"]["mean"] > 0 and got["tokens"] > 0  # the one-shot preset answers in the box (0.43 on 100 x 16)
