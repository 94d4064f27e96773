"""Prompt data for the cluster runs: DAPO-Math-17k (train) and AIME24, AIME25, AMC (eval) as OpenRLHF prompt JSONL.

    python -m experiments.openrlhf.data                          # all four, from the HF hub, into data/openrlhf/
    python -m experiments.openrlhf.data --only aime24 amc --out /shared/nsr-data
    python -m experiments.openrlhf.data --source aime24=/path/aime24.parquet   # a local copy instead of the hub

Each output row: ``{"prompt": problem + BOXED_INSTRUCTION, "label": answer, "datasource": name, "problem_id": id}``;
OpenRLHF reads ``--data.input_key prompt --data.label_key label`` (experiments/openrlhf/argv.py) and reports eval
metrics per ``datasource``. The train file holds passes over the deduplicated problems, each pass in a seeded order,
until it has ``--rows`` rows (default: the most any cluster preset may draw, plan.rows_needed, which counts the
prompts dynamic filtering replaces). OpenRLHF keeps the first ``--data.max_samples`` rows and shuffles them as one
pool, so a problem may come back before every other problem has been seen; over a run each is drawn about equally.
DAPO-Math-17k ships every problem wrapped in its "Answer:" instruction, 100 times over; the problem is cut out
and re-wrapped with the boxed instruction the reward (experiments/rewards/math.py) checks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from experiments.openrlhf.plan import rows_needed
from experiments.rundir import REPO_ROOT, atomic_write_text
from nsr.registry import Registry

DEFAULT_OUT = REPO_ROOT / "data" / "openrlhf"
BOXED_INSTRUCTION = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
DAPO_HEAD = "Solve the following math problem step by step."
DAPO_TAIL = "\n\nRemember to put your answer on its own line after"


@dataclass(frozen=True)
class Source:
    hub_id: str
    split: str
    extract: Callable[[dict, int], tuple[str, str, str]]
    """row, row number -> (problem, answer, problem_id)."""
    train: bool = False


SOURCES: Registry[Source] = Registry("benchmark")


def dapo_problem(prompt) -> str:
    """The bare problem inside DAPO-Math-17k's prompt (a chat list or a string); unchanged if not DAPO-wrapped."""
    text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
    if text.startswith(DAPO_HEAD) and DAPO_TAIL in text:
        text = text[len(DAPO_HEAD) :].split(DAPO_TAIL)[0]
        text = text.split("\n\n", 1)[1] if "\n\n" in text else text  # drop the rest of the instruction paragraph
    return text.strip()


def _get(row: dict, *keys):
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    raise KeyError(f"none of the fields {', '.join(keys)} in row with fields {', '.join(sorted(row))}")


def _plain(row: dict, i: int) -> tuple[str, str, str]:
    problem = str(_get(row, "problem", "Problem", "question")).strip()
    answer = str(_get(row, "answer", "Answer")).strip()
    pid = row.get("id", row.get("ID", row.get("url", i)))
    return problem, answer, str(pid)


def _dapo(row: dict, i: int) -> tuple[str, str, str]:
    problem = dapo_problem(_get(row, "prompt"))
    answer = str(_get(row, "reward_model")["ground_truth"]).strip()
    extra = row.get("extra_info") or {}
    return problem, answer, str(extra.get("index", i))


SOURCES.register("dapo-math-17k")(Source("BytedTsinghua-SIA/DAPO-Math-17k", "train", _dapo, train=True))
SOURCES.register("aime24")(Source("HuggingFaceH4/aime_2024", "train", _plain))
SOURCES.register("aime25")(Source("math-ai/aime25", "test", _plain))
SOURCES.register("amc")(Source("AI-MO/aimo-validation-amc", "train", _plain))


def load_rows(name: str, path: str | None = None) -> list[dict]:
    """Rows of benchmark ``name`` from the hub, or from ``path`` (a local .jsonl/.json/.parquet/.csv file or a
    dataset folder), through the same HF ``datasets`` loader."""
    import datasets

    src = SOURCES[name]
    if path is None:
        ds = datasets.load_dataset(src.hub_id, split=src.split)
    elif Path(path).is_dir():
        ds = datasets.load_from_disk(path)
        ds = ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(Path(path).suffix)
        if kind is None:
            raise ValueError(f"--source {name}={path}: allowed: a .jsonl, .json, .parquet or .csv file, or a folder")
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    return [dict(r) for r in ds]


def convert(name: str, rows: Iterable[dict]) -> list[dict]:
    """OpenRLHF prompt rows, one per distinct problem (first occurrence kept), in input order."""
    extract = SOURCES[name].extract
    out, seen = [], set()
    for i, row in enumerate(rows):
        problem, answer, pid = extract(row, i)
        if not problem or not answer or problem in seen:
            continue
        seen.add(problem)
        out.append({"prompt": problem + BOXED_INSTRUCTION, "label": answer, "datasource": name, "problem_id": pid})
    return out


def repeat_shuffled(rows: list[dict], epochs: int, seed: int = 0) -> list[dict]:
    """``epochs`` passes over ``rows``, each in its own seeded order (whole passes first: see the module doc)."""
    rng = random.Random(seed)
    out = []
    for _ in range(epochs):
        order = list(range(len(rows)))
        rng.shuffle(order)
        out += [rows[i] for i in order]
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def preset_rows() -> int:
    """The most prompt rows any cluster preset may draw (experiments.openrlhf.plan.rows_needed)."""
    from experiments.config import load_config

    presets = sorted((REPO_ROOT / "sweeps" / "presets").glob("*.yaml"))
    cfgs = [load_config(p) for p in presets]
    return max(rows_needed(c) for c in cfgs if c.backend == "openrlhf")


def fix_commands(cfgs) -> list[str]:
    """The commands that write the training prompts ``cfgs`` (openrlhf RunConfigs short of rows) need: one per
    training file, with the most rows any of them draws. A file named after no source of this module is the user's own
    data, said so."""
    from experiments.openrlhf.plan import train_data_path

    need: dict[Path, int] = {}
    for cfg in cfgs:
        path = train_data_path(cfg)
        need[path] = max(need.get(path, 0), rows_needed(cfg))
    out = []
    for path, rows in need.items():
        if path.stem not in SOURCES:
            out.append(
                f"write {rows} prompt rows to {path} (it names no source of python -m experiments.openrlhf.data)"
            )
            continue
        where = "" if path.parent.resolve() == DEFAULT_OUT.resolve() else f" --out {path.parent}"
        out.append(f"python -m experiments.openrlhf.data --only {path.stem}{where} --rows {rows}")
    return out


def prepare(out: Path, only: list[str], sources: dict[str, str], rows: int, seed: int = 0) -> dict[str, int]:
    """Write ``<out>/<name>.jsonl`` for each name (a train set: whole passes until >= ``rows`` rows); returns
    {name: rows written}."""
    written = {}
    for name in only:
        problems = convert(name, load_rows(name, sources.get(name)))
        if not problems:
            raise ValueError(f"{name}: no usable rows (problem and answer fields) in the source")
        rows_out = problems
        if SOURCES[name].train:
            rows_out = repeat_shuffled(problems, -(-rows // len(problems)), seed)
        write_jsonl(out / f"{name}.jsonl", rows_out)
        written[name] = len(rows_out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.openrlhf.data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--only", nargs="+", default=list(SOURCES), help=f"subset of: {', '.join(SOURCES)}")
    p.add_argument("--source", action="append", default=[], metavar="NAME=PATH", help="a local copy of a source")
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="train rows to write at least (default: the most any cluster preset draws, with dynamic filtering's "
        "headroom)",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        for name in a.only:
            SOURCES[name]
        sources = {}
        for item in a.source:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--source {item!r} is not NAME=PATH")
            SOURCES[name]
            sources[name] = path
        rows = preset_rows() if a.rows is None else a.rows
        if rows < 1:
            raise ValueError(f"--rows={rows} is not valid; allowed: >= 1")
        written = prepare(a.out, a.only, sources, rows, a.seed)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, n in written.items():
        print(f"{a.out / (name + '.jsonl')}: {n} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
