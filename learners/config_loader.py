"""Reading a YAML config into a raw mapping before validation: `extends: <file>` (a base config, resolved first and
merged under), `dotted.key=value` overrides, and where each key was written, so that an error names the file and
the line it came from. learners/config.py validates the result into a `RunConfig`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A config that cannot be used; the message names file, line and field."""


def _match(node: yaml.Node | None, path: tuple) -> tuple[int, int | None]:
    """How many leading keys of `path` (keys and list indices) a composed YAML node tree holds, and the 1-based line
    of the last one it holds."""
    depth, line = 0, None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(key)]
            if not match:
                break
            line, node = match[0][0].start_mark.line + 1, match[0][1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
        depth += 1
    return depth, line


def _line_of(node: yaml.Node | None, path: tuple) -> int | None:
    """The 1-based line of `path` (keys and list indices) in a composed YAML node tree."""
    return _match(node, path)[1]


def parse_override(text: str) -> tuple[list[str], object]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML, so 3 -> int, true -> bool, [1,2] -> list)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.split("."), value


def merge(base: dict, over: dict) -> dict:
    """`over` merged over `base`: mappings merged key by key, recursively; lists and scalars replaced."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


@dataclass
class RawConfig:
    """A config file read and resolved: its merged mapping, and each file's YAML node tree (the file itself first,
    then its base, its base's base...) to say where a key came from."""
    path: Path
    raw: dict
    files: list[tuple[Path, yaml.Node]]
    overridden: set = field(default_factory=set)

    def origin(self, loc: tuple) -> str:
        """Where the key at `loc` was set: a command-line override, a line of the file (of a base file: its name
        too), or nowhere."""
        if any(loc[:len(o)] == o for o in self.overridden):
            return "command-line override"
        depth, line, where = 0, None, None
        for path, root in self.files:  # the file that holds most of the key's path; the extending one on a tie
            d, ln = _match(root, loc)
            if d > depth:
                depth, line, where = d, ln, path
        if line is None:
            return "not set in file"
        return f"line {line}" if where == self.path else f"line {line} of {where}"

    def invalid(self, e: ValidationError) -> ConfigError:
        problems = [f"  {'.'.join(str(p) for p in err['loc']) or '(top level)'} ({self.origin(tuple(err['loc']))}): "
                    f"{err['msg']}" for err in e.errors()]
        return ConfigError(f"{self.path}: invalid config\n" + "\n".join(problems))


def read_config(path: str | os.PathLike, chain: tuple[Path, ...] = ()) -> RawConfig:
    """A YAML config file as a mapping, its `extends:` base (a path relative to the file) merged under it."""
    path = Path(path)
    if path.resolve() in [p.resolve() for p in chain]:
        raise ConfigError("extends cycle: " + " -> ".join(str(p) for p in chain + (path,)))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        where = f"{chain[-1]}: extends {path}" if chain else str(path)
        raise ConfigError(f"{where}: cannot read config ({e})") from None
    try:
        root = yaml.compose(text)
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    if "extends" not in raw:
        return RawConfig(path, raw, [(path, root)])
    base_name = raw.pop("extends")
    if not isinstance(base_name, str) or not base_name:
        raise ConfigError(f"{path}: extends (line {_line_of(root, ('extends',))}): a config file's path, relative "
                          f"to this file, got {base_name!r}")
    base = read_config(path.parent / base_name, chain + (path,))
    return RawConfig(path, merge(base.raw, raw), [(path, root)] + base.files)


def apply_overrides(config: RawConfig, overrides: list[str]) -> None:
    """Each `dotted.key=value` into the mapping (list items by position: rewards.components.1.weight=2)."""
    for text_override in overrides:
        keys, value = parse_override(text_override)
        keys = [int(k) if k.isdigit() else k for k in keys]
        node = config.raw
        for k in keys[:-1]:
            if isinstance(node, list):
                if not isinstance(k, int) or k >= len(node):
                    raise ConfigError(f"override {text_override!r}: no item {k!r} in a list of {len(node)}")
                node = node[k]
            elif not isinstance(node.get(k, {}), (dict, list)):
                raise ConfigError(f"override {text_override!r}: {k!r} is not a section")
            else:
                node = node.setdefault(k, {})
        if isinstance(node, list) and not (isinstance(keys[-1], int) and keys[-1] < len(node)):
            raise ConfigError(f"override {text_override!r}: no item {keys[-1]!r} in a list of {len(node)}")
        node[keys[-1]] = value
        config.overridden.add(tuple(keys))
