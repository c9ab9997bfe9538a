"""Command-line flags generated from a config dataclass, so that every key, nested ones included, is a flag.

A key `engine.max_slots` becomes `--max-slots` (leaf names are unique across a config), and a flag
given on the command line overrides the YAML value; flags not given leave the config alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

_DEST = "config:"


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, type) of every non-dataclass field of `cls`, depth first. An optional dataclass (`quantize`) is
    set in the YAML only: its fields have no defaults to override one at a time."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if any(dataclasses.is_dataclass(a) for a in typing.get_args(hint)):
            continue
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            out.append((f"{prefix}{f.name}", hint))
    return out


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, help_for: dict[str, str] | None = None) -> None:
    """Adds `--key` for every leaf key of the config dataclass `cls`."""
    seen: dict[str, str] = {}
    for path, hint in _leaves(cls):
        name = path.rsplit(".", 1)[-1]
        if name in seen:
            raise ValueError(f"{cls.__name__}: keys {seen[name]} and {path} would share the flag --{name}")
        seen[name] = path
        kwargs: dict[str, Any] = {"dest": _DEST + path, "default": argparse.SUPPRESS, "metavar": name.upper(),
                                  "help": (help_for or {}).get(path, f"overrides `{path}` of the config")}
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
        if base is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, metavar=None)
        elif typing.get_origin(base) is tuple:
            kwargs.update(nargs="*", type=typing.get_args(base)[0])
        elif base in (int, float, str):
            kwargs["type"] = base
        else:
            raise ValueError(f"{cls.__name__}.{path}: no flag for type {hint}")
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """{dotted path: value} of the config flags given on the command line."""
    return {k[len(_DEST):]: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k.startswith(_DEST)}


def with_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """A copy of the frozen config `cfg` with dotted paths replaced; every touched dataclass validates again."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in overrides.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, sub in nested.items():
        top[head] = with_overrides(getattr(cfg, head), sub)
    return dataclasses.replace(cfg, **top) if top else cfg
