"""Load OpenRLHF 0.11.2's own loss code from the installed package, without its heavy imports.

``openrlhf.models`` imports flash-attn, deepspeed and transformers at package import, none of which a laptop
or CI can install (flash-attn needs CUDA). Its loss lives in two plain files, ``models/utils.py`` and
``models/loss.py``; OpenRLHF's own tests load them by path, and so do we, under a private package name, with
a placeholder ``deepspeed`` module unless the real one is already imported (``utils.py`` imports it at the top and
never uses it in the functions we call). The code that runs is OpenRLHF's, byte for byte.

On a cluster, where ``import openrlhf.models.loss`` works, :func:`load_loss_module` returns the real module.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

SUPPORTED_VERSION = "0.11.2"
_PKG = "_openrlhf_ref_models"


def openrlhf_root() -> Path:
    """Folder of the installed ``openrlhf`` package, found without importing it."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"openrlhf is not installed; install it with `pip install --no-deps openrlhf=={SUPPORTED_VERSION}` "
            "(CPU) or `pip install -r requirements.txt` (cluster)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_openrlhf_file(relpath: str, name: str) -> types.ModuleType:
    """One file of the installed openrlhf package (``relpath`` under its folder, e.g. ``utils/config.py``), loaded by
    path as module ``name`` without importing the package (whose ``__init__`` pulls in CUDA-only dependencies)."""
    spec = importlib.util.spec_from_file_location(name, openrlhf_root() / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_version() -> str:
    from importlib.metadata import version

    return version("openrlhf")


def load_loss_module(prefer_real: bool = False) -> types.ModuleType:
    """OpenRLHF's ``models/loss.py`` (with ``PolicyLoss`` and ``aggregate_loss``).

    Args:
        prefer_real: import ``openrlhf.models.loss`` normally when that works (cluster), else load by path.
    """
    if prefer_real:
        try:
            import openrlhf.models.loss as real

            return real
        except ImportError:
            pass
    if f"{_PKG}.loss" in sys.modules:
        return sys.modules[f"{_PKG}.loss"]
    models = openrlhf_root() / "models"
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [str(models)]
    sys.modules[_PKG] = pkg
    # utils.py imports deepspeed at the top and the loss functions never use it: a placeholder unless it is already
    # imported (a real import costs seconds and sets up DeepSpeed's accelerator)
    placeholder = "deepspeed" not in sys.modules
    if placeholder:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        for name in ("utils", "loss"):
            spec = importlib.util.spec_from_file_location(f"{_PKG}.{name}", models / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    finally:
        if placeholder:  # leave no fake package behind for later imports (transformers probes for deepspeed)
            del sys.modules["deepspeed"]
    return sys.modules[f"{_PKG}.loss"]
