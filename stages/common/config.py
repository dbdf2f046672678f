"""Typed, frozen stage configs loaded from one section of params.yaml.

Every stage declares a frozen dataclass whose fields are its params section. Loading checks the
section against the dataclass before any compute: unknown keys, missing keys and wrong types each
stop with one message naming the key and what to change, e.g.

    params.yaml: tokenize.vocab_size must be an int, got 'big'

`key=value` overrides from the command line are parsed as YAML scalars and checked the same way.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class UserError(Exception):
    """Bad input a user must fix (params, data, paths); printed as one line, with no traceback."""


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


def build(cls: type, section: str, values: Any, source: str = "params.yaml"):
    """Check a mapping against the dataclass `cls` and build it."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key {section}.{unknown[0]}; valid keys are: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, field in fields.items():
        if name not in values:
            has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise ConfigError(f"{source}: missing key {section}.{name}; add it to the '{section}' section")
        ok, conv = _coerce(values[name], hints[name])
        if not ok:
            raise ConfigError(f"{source}: {section}.{name} must be {_type_name(hints[name])}, got {values[name]!r}")
        kwargs[name] = conv
    try:
        return cls(**kwargs)
    except ValueError as e:  # __post_init__ range checks
        raise ConfigError(f"{source}: {section}.{e}") from None


def parse_overrides(section: str, overrides: list[str]) -> dict:
    """`key=value` or `<section>.key=value` pairs; values are YAML scalars (`lr=3e-4`, `tags=[a,b]`)."""
    out = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"command line: override '{item}' must look like key=value")
        if "." in key:
            prefix, _, key = key.partition(".")
            if prefix != section:
                raise ConfigError(f"command line: override '{item}' is for section '{prefix}', not '{section}'")
        try:
            out[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            out[key] = raw
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
        values = {**values, **parse_overrides(section, list(overrides))}
    return build(cls, section, values, source=str(params))


def as_dict(cfg) -> dict:
    """Plain, JSON-friendly dict of a config (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def parse_cli(doc: str, paths: dict, argv=None):
    """The command line every stage shares: path options (name -> default; a list default takes one
    or more paths), `--params FILE`, and trailing `key=value` overrides of the stage's params section.
    Returns (args, overrides)."""
    import argparse

    parser = argparse.ArgumentParser(
        description=doc.strip().splitlines()[0], epilog="Trailing key=value pairs override the stage's params section."
    )
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    for name, default in paths.items():
        many = isinstance(default, list)
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=default,
            nargs="+" if many else None,
            help=f"default: {default}",
        )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    # Intermixed: overrides may come before, between or after the options.
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    for name, default in paths.items():
        if isinstance(default, list):
            # `--inputs a b key=value`: argparse hands the override to --inputs; give it back.
            values = getattr(args, name)
            setattr(args, name, [v for v in values if "=" not in v])
            overrides += [v for v in values if "=" in v]
    return args, overrides


def run(main) -> None:
    """Entry point of `python -m stages.<name>`: a UserError becomes one line on stderr and exit code 2."""
    import sys

    try:
        main()
    except UserError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
