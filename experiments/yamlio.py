"""The one YAML reader of the repo (configs, presets, sweeps, the site file, claims files, run folders): safe loading,
duplicate keys refused, every error a ConfigError naming the file, the line and the key.

    from experiments.yamlio import load_yaml, read_yaml
    data = read_yaml("sweeps/delta.yaml", what="sweep")   # a non-empty mapping, or ConfigError
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from experiments.config_errors import ConfigError


class _UniqueKeys:
    """A safe YAML loader's mapping constructor that refuses a key given twice in one mapping (PyYAML keeps the last
    one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in first_line:
                        raise yaml.constructor.ConstructorError(
                            None,
                            None,
                            f"duplicate key {key!r} (first at line {first_line[key]}); allowed: each key once",
                            key_node.start_mark,
                        )
                    first_line[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: SafeLoader's own error says so below
                    continue
        return super().construct_mapping(node, deep=deep)


class _UniqueKeyLoader(_UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """Safe loading (libyaml's parser where installed: 7x faster on run folders) with duplicate keys refused."""


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """YAML ``text`` as Python values, refusing duplicate keys; ConfigError naming ``source``, the line and the key.

    Safe (no arbitrary objects). An empty document gives None.
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}:" if mark is not None else ""
        what = "" if str(e.problem).startswith("duplicate key") else " not valid YAML:"
        raise ConfigError(f"{source}:{where}{what} {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None


def load_yaml(path: str | Path) -> Any:
    """The one YAML reader of the repo (configs, presets, sweeps, the site file, claims files, run folders).

    Returns the parsed document (None for an empty file). Raises ConfigError (a ValueError) naming the file: no such
    file, not a text file (binary data), not valid YAML, or a duplicate key (with its line and the first one's).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder; allowed: a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8); allowed: a YAML file") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: not a text file (a NUL byte at {text.index(chr(0))}); allowed: a YAML file")
    return parse_yaml(text, str(path))


def read_yaml(path: str | Path, what: str = "config") -> dict:
    """A YAML file that must be a non-empty mapping (a config, a preset, a sweep); ConfigError otherwise."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such {what} file")
    data = load_yaml(path)
    if data is None or data == {}:
        hint = (
            "to run the defaults, say so: start from a preset (sweeps/presets/tiny.yaml, tiny-smoke.yaml) or "
            "write the keys you mean (e.g. `backend: tiny`)"
            if what == "config"
            else "allowed: a mapping of keys"
        )
        raise ConfigError(f"{path}: empty {what} file (no keys); {hint}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(data).__name__}")
    return data
