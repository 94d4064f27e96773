"""Data preparation (experiments/openrlhf/data.py) on small local copies of the sources, shaped like the hub sets,
through the same HF ``datasets`` loaders; the output is read back with OpenRLHF's own preprocess_data."""

import json
from pathlib import Path

import pytest

from experiments.openrlhf import data
from experiments.openrlhf.plan import count_rows
from experiments.rewards.math import score
from nsr.openrlhf.reference import load_openrlhf_file

SRC = Path(__file__).parent / "fixtures" / "openrlhf" / "sources"
LOCAL = {
    "dapo-math-17k": SRC / "dapo-math-17k.jsonl",
    "aime24": SRC / "aime24.jsonl",
    "aime25": SRC / "aime25.parquet",
    "amc": SRC / "amc.jsonl",
}


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    argv = ["--out", str(out), "--rows", "10"] + [a for n, p in LOCAL.items() for a in ("--source", f"{n}={p}")]
    assert data.main(argv) == 0
    return out


def test_every_benchmark_is_written(prepared):
    assert sorted(p.name for p in prepared.glob("*.jsonl")) == sorted(f"{n}.jsonl" for n in data.SOURCES)
    for name in ("aime24", "aime25", "amc"):
        rows = _read(prepared / f"{name}.jsonl")
        assert len(rows) == 2 and {r["datasource"] for r in rows} == {name}
        assert all(r["prompt"].endswith(data.BOXED_INSTRUCTION) for r in rows)
    aime25 = _read(prepared / "aime25.jsonl")
    assert [r["problem_id"] for r in aime25] == ["2025-I-60", "2025-I-61"]  # ID / Problem / Answer fields
    assert [r["label"] for r in _read(prepared / "amc.jsonl")] == ["12.0", "2.5"]


def test_dapo_train_set_is_deduplicated_unwrapped_and_repeated(prepared):
    rows = _read(prepared / "dapo-math-17k.jsonl")
    assert len(rows) == 3 * 4  # 3 distinct problems (shipped 3 times each): 4 whole passes reach --rows 10
    first = rows[:3]
    assert sorted(r["problem_id"] for r in first) == ["idx-0", "idx-1", "idx-2"]  # each pass is a whole pass
    prompt = next(r["prompt"] for r in rows if r["problem_id"] == "idx-1")
    assert prompt == "Compute $\\frac{1}{2}+\\frac{1}{4}$." + data.BOXED_INSTRUCTION  # DAPO's "Answer:" wrapper cut
    assert count_rows(prepared / "dapo-math-17k.jsonl") == 12
    orders = [[r["problem_id"] for r in rows[i : i + 3]] for i in range(0, 12, 3)]
    assert len({tuple(o) for o in orders}) > 1  # passes are shuffled differently (seeded)
    source = data.load_rows("dapo-math-17k", LOCAL["dapo-math-17k"])
    again = data.repeat_shuffled(data.convert("dapo-math-17k", source), 4)
    assert again == rows  # same seed, same file


def test_labels_score_with_the_reward(prepared):
    for name in ("aime24", "amc", "dapo-math-17k"):
        for r in _read(prepared / f"{name}.jsonl"):
            assert score(f"... so the answer is \\boxed{{{r['label']}}}.", r["label"]) == 1.0


def test_openrlhfs_preprocess_reads_our_rows(prepared):
    mod = load_openrlhf_file("datasets/prompts_dataset.py", "_openrlhf_prompts_dataset")
    row = _read(prepared / "aime24.jsonl")[0]
    prompt, label = mod.preprocess_data(row, None, "prompt", "label", None)
    assert (prompt, label) == (row["prompt"], row["label"])
    chat = mod.preprocess_data(row, None, "prompt", "label", lambda c, **kw: c)[0]
    assert chat == [{"role": "user", "content": row["prompt"]}]  # --data.apply_chat_template wraps it as a user turn


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert data.main(["--only", "aime26", "--out", str(tmp_path)]) == 2
    assert "benchmark='aime26' is not valid; allowed: dapo-math-17k, aime24, aime25, amc" in capsys.readouterr().err
    assert data.main(["--only", "amc", "--source", f"amc={SRC / 'x.txt'}", "--out", str(tmp_path)]) == 2
    assert "allowed: a .jsonl" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
