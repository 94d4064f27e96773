"""OpenRLHF 0.11.2's own ``train_ppo_ray`` parser and argument checks, run without Ray, vLLM, torch or a GPU.

OpenRLHF builds its parser inside ``if __name__ == "__main__":`` (cli/train_ppo_ray.py), so it cannot be imported.
This module reads the installed file, takes that block's statements with ``ast``, and executes them:
everything before ``args = parser.parse_args()`` gives the parser (its 168 flags, choices, nargs and defaults);
the statements after it (``hierarchize`` and the validation asserts) run too, all but the final ``train(args)``.
The code that parses is OpenRLHF's, byte for byte; only ``hierarchize`` is loaded by file path (it imports nothing).

    from nsr.openrlhf.cli import parse
    args = parse(["--actor.model_name_or_path", "Qwen/Qwen2.5-Math-7B", ...])   # nested SimpleNamespace
    args.actor.eps_clip_low_high   # [0.2, 0.28]

Used by ``experiments.run --dry-run`` (every printed command is checked) and by the tests.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import io
import os
from functools import cache
from types import SimpleNamespace

from nsr.openrlhf.reference import load_openrlhf_file, openrlhf_root

CLI_FILE = ("cli", "train_ppo_ray.py")


class CLIError(ValueError):
    """OpenRLHF's parser or one of its checks refused a command line; the message is OpenRLHF's."""


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _is_parse_args(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "parse_args"
    )


@cache
def _main_block() -> tuple[ast.Module, ast.Module]:
    """(statements that build ``parser``, statements that check ``args``) of the installed CLI's __main__ block."""
    path = openrlhf_root().joinpath(*CLI_FILE)
    tree = ast.parse(path.read_text(), filename=str(path))
    guards = [n for n in tree.body if _is_main_guard(n)]
    if len(guards) != 1:
        raise RuntimeError(f"{path}: expected one `if __name__ == '__main__':` block, found {len(guards)}")
    body = guards[0].body
    cut = [i for i, n in enumerate(body) if _is_parse_args(n)]
    if len(cut) != 1:
        raise RuntimeError(f"{path}: expected one `args = parser.parse_args()` in the __main__ block")
    checks = []
    for n in body[cut[0] + 1 :]:
        if isinstance(n, ast.ImportFrom) and n.module == "openrlhf.utils.config":
            continue  # hierarchize is provided below, loaded by path
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "train":
            continue  # the only statement that starts anything
        checks.append(n)
    return ast.Module(body[: cut[0]], type_ignores=[]), ast.Module(checks, type_ignores=[])


@cache
def _hierarchize():
    return load_openrlhf_file("utils/config.py", "_openrlhf_utils_config").hierarchize


def build_parser() -> argparse.ArgumentParser:
    """A fresh copy of OpenRLHF 0.11.2's ``train_ppo_ray`` argument parser."""
    build, _ = _main_block()
    # the module-level names the block uses (the file does `from datetime import datetime`)
    ns = {"argparse": argparse, "datetime": datetime.datetime, "os": os, "__name__": "__main__"}
    exec(compile(build, "openrlhf/cli/train_ppo_ray.py", "exec"), ns)
    return ns["parser"]


def parse(argv: list[str], validate: bool = True) -> SimpleNamespace:
    """OpenRLHF's ``args`` for ``argv``: parsed, hierarchized and (``validate``) passed through its checks.

    Raises CLIError with OpenRLHF's message on an unknown flag, a bad value or a failed check.
    """
    parser = build_parser()
    parser.prog = "openrlhf.cli.train_ppo_ray"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            flat = parser.parse_args(list(argv))
    except SystemExit as e:
        if e.code == 0:  # --help: the usage went to stdout; exit 0 as OpenRLHF's own command does
            raise
        raise CLIError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "bad arguments") from None
    _, checks = _main_block()
    ns = {"args": flat, "hierarchize": _hierarchize(), "__name__": "__main__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # OpenRLHF prints its warnings
            exec(compile(ast.Module([checks.body[0]], type_ignores=[]), "train_ppo_ray.py", "exec"), ns)
            if validate:
                exec(compile(ast.Module(checks.body[1:], type_ignores=[]), "train_ppo_ray.py", "exec"), ns)
    except AssertionError as e:
        raise CLIError(f"OpenRLHF refused the command: {e}") from None
    return ns["args"]
