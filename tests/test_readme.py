"""README.md is the repo's door: it answers "Does NSR work?" near the top with links to where each clause is shown,
names the four jobs with their commands, and its snippets for using NSR in one's own trainer work as pasted: the TRL
script trains on a tiny local model (the model id is the one thing replaced), and the verl lines compose into verl's
own trainer config and select NSR's loss, which then runs on a tiny model's log-probs. Every relative link of the
README and the docs resolves, anchors included."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PLUGINS = (ROOT / "docs/plugins.md").read_text()
MAX_LINES = 180
HUB_ID = '"Qwen/Qwen2.5-0.5B-Instruct"'
"""The model of the README's TRL script: the test runs it on a tiny local folder instead (no hub in tests)."""


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line index, level, title) of every heading outside fenced code (a ``# comment`` in a code block is none)."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+) (.*?)\s*$", line)):
            out.append((i, len(m.group(1)), m.group(2)))
    return out


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` (or deeper) up to the next heading of the same or a higher level."""
    lines, marks = text.splitlines(), headings(text)
    found = [(i, level) for i, level, title in marks if title == heading]
    assert found, f"no heading {heading!r}"
    (start, level), *_ = found
    end = next((i for i, lv, _ in marks if i > start and lv <= level), len(lines))
    return "\n".join(lines[start + 1 : end]) + "\n"


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def job(n: int) -> str:
    """The README's text of job ``n`` (from its bold title to the next job's or the next heading)."""
    part = section(README, "The four jobs")
    m = re.search(rf"^\*\*{n}\. ", part, re.M)
    assert m, f"job {n} is not named"
    nxt = re.compile(rf"^\*\*{n + 1}\. ", re.M).search(part, m.end())
    return part[m.start() : nxt.start() if nxt else len(part)]


def trl_script() -> str:
    (code,) = blocks(job(4), "python")
    return code


def verl_lines(text: str) -> list[str]:
    code = next(b for b in blocks(text, "bash") if "actor_rollout_ref." in b)
    return [line.strip().rstrip("\\").strip() for line in code.splitlines() if line.strip()]


def test_the_readme_answers_does_nsr_work_first():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; allowed: at most {MAX_LINES}"
    start = lines.index("## Does NSR work?")
    answer = section(README, "Does NSR work?")
    assert start + answer.count("\n") < 40, "the answer must end before line 40"
    assert section("# a\n```\n# code\n```\ntext\n# b\n", "a") == "```\n# code\n```\ntext\n"  # code is no heading
    bullets = re.findall(r"^- \*\*(\w+):\*\*(.*?)(?=^- |\Z)", answer, re.M | re.S)
    assert [b[0] for b in bullets] == ["Run", "Shown", "Untested"]
    for name, text in bullets:  # each clause of the answer says where it is shown
        assert len(re.findall(r"\]\((?:docs|results)/[^)]+\)", text)) >= 3, name
    prose = re.sub(r"\]\([^)]*\)", "]", README)  # link targets aside (a heading's anchor may hold its date)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", prose), "dated runs belong in docs/testbed.md or the commit log"


def test_the_readme_names_the_four_jobs_with_their_commands():
    want = {1: "python -m slurm.submit", 2: "python -m experiments.run --sweep", 3: "python -m analysis.make_all"}
    for n, command in want.items():
        assert command in "".join(blocks(job(n), "bash")), n
    assert "Use NSR in your own trainer" in job(4) and "NSRGRPOTrainer" in trl_script()
    assert verl_lines(job(4)) and "python -m nsr.openrlhf.launch" in job(4)


def test_plugins_gives_each_framework_its_section_with_the_readmes_snippets():
    for name in ("TRL", "verl", "OpenRLHF"):
        assert section(PLUGINS, name).strip(), name
    assert blocks(section(PLUGINS, "TRL"), "python") == [trl_script()]
    assert verl_lines(section(PLUGINS, "verl")) == verl_lines(job(4))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and spaces dropped, spaces -> hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(title) for _, _, title in headings(path.read_text())}


@pytest.mark.parametrize(
    "page", ["README.md", "results/README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))]
)
def test_every_relative_link_resolves(page):
    path = ROOT / page if "/" in page or page == "README.md" else ROOT / "docs" / page
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(target)
    assert bad == [], f"{page}: links that do not resolve"


def test_the_readmes_verl_lines_compose_and_run_nsr_on_a_tiny_model():
    """The lines, as pasted among a recipe's overrides, composed by hydra into verl 0.9.1's own ppo_trainer.yaml and
    read as verl's actor worker reads them; the loss they select (found through verl's own lookup) runs on the
    log-probs of a tiny causal LM whose ratios straddle the trust region, rescues tokens and backpropagates."""
    pytest.importorskip("verl", reason="verl is installed by `make venv` (pip install --no-deps verl==0.9.1)")
    import os

    import torch
    import trl_tiny
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass

    import nsr.verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    recipe = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # every recipe sets a micro-batch size
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[*recipe, *verl_lines(job(4))])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor.policy_loss) is nsr.verl.NSRPolicyLossConfig
    assert (actor.policy_loss.loss_mode, actor.policy_loss.delta) == ("nsr:nsr", 0.2)
    fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    assert fn.__module__.startswith("nsr.verl")

    model = trl_tiny.dense_lm(seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, trl_tiny.VOCAB, (4, 12), generator=g)
    logits = model(input_ids=ids).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ratio = torch.empty_like(logp).uniform_(0.55, 1.6, generator=g)  # inside, near and beyond the region's edges
    old = (logp - ratio.log()).detach()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand_as(logp).contiguous()
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                       loss_agg_mode="token-mean", config=actor)  # fmt: skip
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads) and any(x.abs().sum() > 0 for x in grads)
    assert float(metrics["actor/nsr_clip_frac"]) > 0 and float(metrics["actor/nsr_rescue_frac"]) > 0


RUN_SCRIPT = r"""
import json, sys
namespace = {}
exec(compile(sys.stdin.read(), "README.md (job 4, TRL)", "exec"), namespace)
trainer = namespace["trainer"]
print(json.dumps({"type": type(trainer).__name__, "rule": trainer.nsr_loss.rule, "delta": trainer.nsr_loss.delta,
                  "eps": [trainer.nsr_loss.eps_low, trainer.nsr_loss.eps_high],
                  "steps": trainer.state.global_step, "log": trainer.state.log_history}))
"""


@pytest.mark.slow
def test_the_readmes_trl_script_trains_as_pasted_on_a_tiny_model(tmp_path):
    """The README's TRL script, its model id replaced by a tiny local Qwen2 folder (tests/trl_tiny.py) and nothing
    else, run in a fresh process in an empty folder: NSRGRPOTrainer trains its 2 steps with NSR and logs NSR's
    metrics, with the GRPOConfig's trust region (set once, there). About 20 s."""
    pytest.importorskip("trl", reason="trl is installed by `make venv` (trl==1.16.0)")
    import trl_tiny

    folder = trl_tiny.save_models(tmp_path / "models")["dense"]
    script = trl_script()
    assert script.count(HUB_ID) == 1
    work = tmp_path / "work"
    work.mkdir()
    env = {**__import__("os").environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN_SCRIPT], input=script.replace(HUB_ID, json.dumps(folder)),
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["type"], got["rule"], got["delta"], got["steps"]) == ("NSRGRPOTrainer", "nsr", 0.2, 2)
    assert got["eps"] == [0.2, 0.28]  # the trust region is the GRPOConfig's (epsilon default, epsilon_high set)
    last = got["log"][-1]
    assert {"nsr/clip_frac", "nsr/rescue_frac", "train_loss"} <= set(last)
    assert (work / "nsr-grpo").is_dir()  # the output_dir of the script, relative to where it runs
