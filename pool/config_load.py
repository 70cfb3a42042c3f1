"""Reading a config: the YAML file (a key written twice is refused) and `--set a.b=value` overrides.

Nothing here validates: pool/config.py turns the plain dict these give into a `Config`. Both raise
`ConfigError`, which names the key where there is one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot be served; the message names the key (also in `.key` when there is one)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_value(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError:
        return text  # not YAML (e.g. an unbalanced bracket): keep the text, validation names the key


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b=value` sets data["a"]["b"]; `stages.1.device=cuda:1` indexes a list; the value is read as YAML.

    Numbers, `null`, `true` and flow lists (`stages.0.layers=[0,24]`) come out typed; everything else is a
    string. An empty value is refused (YAML would read it as null). Missing sections are created; a list index
    must exist. `data` is changed in place and returned.
    """
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. engine.kv_pool_tokens=8192")
        if not value.strip():  # YAML would read it as null: `--set coordinator.api_key=` must not mean "no key"
            raise ConfigError(f"--set {key}=: an empty value; write {key}=null to unset it, or {key}='' for an "
                              f"empty string", key=key)
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"--set {key}: empty part in the key", key=key)
        node: Any = data
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"--set {key}: {where} has {len(node)} entries, no index {part!r}", key=key)
                index: int | str = int(part)
            elif isinstance(node, dict):
                index = part
            else:
                raise ConfigError(f"--set {key}: {where} is a value ({node!r}), not a section", key=key)
            if depth == len(parts) - 1:
                node[index] = _parse_value(value)
            else:
                node = node.setdefault(index, {}) if isinstance(node, dict) else node[index]
    return data


def read_yaml(path: str | Path) -> dict:
    """The YAML mapping in `path`; ConfigError for a missing file, bad YAML, duplicate keys or a non-mapping."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (model:, coordinator:, engine:, stages:)")
    return data
