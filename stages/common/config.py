"""Typed, frozen stage configs loaded from one section of params.yaml.

Every stage declares a frozen dataclass whose fields are its params section. Loading checks the
section against the dataclass before any compute: unknown keys, missing keys and wrong types each
stop with one message naming the key and what to change, e.g.

    params.yaml: tokenize.vocab_size must be an int, got 'big'

A field typed by another dataclass is a sub-section, e.g. the `train` section of every training stage
(train_config.TrainConfig); its keys are dotted paths: `pretrain.train.lr`. `key=value` overrides from the
command line (`train.lr=3e-4`) are parsed as YAML values and checked the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class UserError(Exception):
    """Bad input a user must fix (params, data, paths); printed as one line, with no traceback."""


# The params sections of params.yaml, one per stage: an override naming another one is a mistake.
STAGE_SECTIONS = (
    "prepare_data",
    "tokenize",
    "pretrain",
    "extend_context",
    "eval_perplexity",
    "eval_harness",
    "finetune_qlora",
    "train_gnn",
    "context_study",
    "memory_study",
    "report",
)


class ConfigError(UserError, ValueError):
    """Bad params: the message names the file, the key and the fix."""


def read_yaml(path: str | Path) -> dict:
    """Read a params/preset file as a mapping; malformed YAML is one clear error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found; pass --params PATH or run from the repository root")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}; fix the file's syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of stage sections, got {type(data).__name__}")
    return data


def merge(base: dict, overlay: dict) -> dict:
    """Deep-merge `overlay` onto `base` (presets are overlays of params.yaml)."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is int:
        return "an int"
    if tp is float:
        return "a float"
    if tp is str:
        return "a string"
    if tp is bool:
        return "a boolean (true/false)"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        (item,) = get_args(tp)[:1]
        return f"a list of {_type_name(item).removeprefix('an ').removeprefix('a ')}s"
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if origin is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, value converted to tp). Ints are accepted where floats are expected."""
    origin = get_origin(tp)
    if tp is Any:
        return True, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        # YAML 1.1 (PyYAML) reads 3e-4, without a dot, as a string; YAML 1.2 and users read a number.
        if isinstance(value, str) and FLOAT_LITERAL.fullmatch(value.strip()):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin is Literal:
        return value in get_args(tp), value
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None
                continue
            ok, conv = _coerce(value, arg)
            if ok:
                return True, conv
        return False, value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        item_tp = get_args(tp)[0]
        out = []
        for v in value:
            ok, conv = _coerce(v, item_tp)
            if not ok:
                return False, value
            out.append(conv)
        return True, tuple(out)
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    raise TypeError(f"unsupported config field type {tp!r}")


def is_section(tp: Any) -> bool:
    """A field typed by a dataclass is a sub-section (a nested mapping in params.yaml)."""
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def build(cls: type, section: str, values: Any, source: str = "params.yaml"):
    """Check a mapping against the dataclass `cls` and build it; sub-sections (fields typed by a
    dataclass) are checked the same way, and every message names the full dotted key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(values, dict):
        raise ConfigError(
            f"{source}: section '{section}' must be a mapping of keys ({', '.join(fields)}), got {values!r}"
        )
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        hint = next(
            (
                f" (did you mean {section}.{name}.{unknown[0]}?)"
                for name in fields
                if is_section(hints[name]) and unknown[0] in {f.name for f in dataclasses.fields(hints[name])}
            ),
            "",
        )
        raise ConfigError(
            f"{source}: unknown key {section}.{unknown[0]}{hint}; valid keys are: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, field in fields.items():
        tp = hints[name]
        if name not in values:
            has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise ConfigError(f"{source}: missing key {section}.{name}; add it to the '{section}' section")
        if is_section(tp):
            kwargs[name] = build(tp, f"{section}.{name}", values[name], source)
            continue
        ok, conv = _coerce(values[name], tp)
        if not ok:
            raise ConfigError(f"{source}: {section}.{name} must be {_type_name(tp)}, got {values[name]!r}")
        kwargs[name] = conv
    try:
        return cls(**kwargs)
    except ConfigError:  # a check that built a config of its own names its keys already
        raise
    except ValueError as e:  # __post_init__ range checks
        raise ConfigError(f"{source}: {section}.{e}") from None


def apply_overrides(section: str, values: dict, overrides: list[str]) -> dict:
    """The section with `key=value` overrides applied. Each key is a dotted path inside the section,
    optionally led by the section's name (`train.lr=3e-4`, `pretrain.train.lr=3e-4`), and its value (a
    YAML scalar or flow collection) replaces what is at that path: `variants.yarn.beta_fast=4` one key of
    a mapping, `variants={linear: {rope_type: linear}}` the whole mapping."""
    out = copy.deepcopy(values)
    for item in overrides:
        key, sep, raw = item.partition("=")
        path = key.split(".")
        if not sep or not all(path):
            raise ConfigError(f"command line: override '{item}' must look like key=value or sub.key=value")
        if len(path) > 1 and path[0] == section:
            path = path[1:]
        elif len(path) > 1 and path[0] in STAGE_SECTIONS:
            raise ConfigError(f"command line: override '{item}' is for section '{path[0]}', not '{section}'")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        for depth, part in enumerate(path[:-1], 1):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                where = ".".join([section, *path[:depth]])
                raise ConfigError(f"command line: override '{item}' sets a key inside {where}, which is a value")
            node = node[part]
        node[path[-1]] = value
    return out


def load(cls: type, section: str, params: str | Path = "params.yaml", overrides: list[str] = ()):
    """Load `section` of a params file (plus command-line overrides) into the frozen dataclass `cls`."""
    data = read_yaml(params)
    if section not in data:
        raise ConfigError(f"{params}: missing section '{section}'; add it (see params.yaml in the repository)")
    values = data[section]
    if overrides:
        if not isinstance(values, dict):
            raise ConfigError(f"{params}: section '{section}' must be a mapping of keys, got {values!r}")
        values = apply_overrides(section, values, list(overrides))
    return build(cls, section, values, source=str(params))


def as_dict(cfg) -> dict:
    """Plain, JSON-friendly nested dict of a config (sub-sections become mappings, tuples lists): its params,
    without a field that holds a path given on the command line (metadata {"path": True}), which is no param."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    paths = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("path")}
    return plain({k: v for k, v in dataclasses.asdict(cfg).items() if k not in paths})


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: a params section or a metrics record as MLflow's flat keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
