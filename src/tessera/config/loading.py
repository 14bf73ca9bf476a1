"""Loading a configuration: a TOML file, then ``--set section.key=value`` overrides, each value
checked against its field's type (strings from the command line parsed), unknown keys refused
with the nearest known one."""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from tessera.config.sections import AUTO, SECTIONS, Config, ConfigError, Switch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# Keys that once existed, with why they went and the values that asked for nothing (their old
# defaults): a config.toml an earlier run wrote holds those and still loads; one that turns a
# removed feature on is refused with the reason.
REMOVED = {
    "parallel.tp_microbatch_pairs": ("micro-batch pairs were removed: their two TP communicators could hang",
                                     ("auto", "false")),
    "parallel.tp_pairs_backward": ("micro-batch pairs were removed: their two TP communicators could hang",
                                   ("threads",)),
    "parallel.tp_async": ("async TP was removed: it measured slower than the plain collectives", ("false",)),
    "parallel.grad_reduce_dtype": ("removed: sending fp32 gradients in bf16 measured no faster; train.grad_dtype=bf16 "
                                   "keeps bf16 gradients throughout", ("fp32",)),
    "train.gc_interval": ("removed: collecting at fixed steps cost more than it saved", ("0",)),
}


# values that once existed, likewise
REMOVED_VALUES = {("parallel.schedule", "zb-h2"): "zb-h2 was removed: it measured slower than zb-h1 at pp=2 "
                                                 "(BENCHMARKS.md, Pipeline parallelism)"}


def _asks_for_nothing(key: str, value: Any) -> bool:
    """A removed key set to the value it had when off."""
    return key in REMOVED and str(value).strip().lower() in REMOVED[key][1]


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(key: str, keys_under: list[str] = ()) -> ConfigError:
    """An unknown ``section.key``, or section (with the ``keys_under`` it was given): the closest
    known name, where one is close."""
    if key in REMOVED:
        return ConfigError(key, REMOVED[key][0], "delete the setting")
    if "." in key:
        close = difflib.get_close_matches(key, _all_keys(), n=1)
    else:
        section = difflib.get_close_matches(key, list(SECTIONS), n=1)
        close = [f"{section[0]}.{k}" for k in keys_under if f"{section[0]}.{k}" in _all_keys()][:1] or section \
            if section else []
    fix = f"did you mean '{close[0]}'?" if close else "`tessera config` lists every key"
    return ConfigError(key, "unknown section" if "." not in key else "unknown key", fix)


def a_or_an(noun: str) -> str:
    """"a str", "an int": for messages that name a type."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check (and for strings from the command line, parse) ``value`` against the field's type."""
    if typing.get_origin(hint) is list and typing.get_args(hint) == (int,):  # a TOML list, or "1,2" from --set
        items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        try:
            if not isinstance(items, list) or any(isinstance(x, (bool, float)) for x in items):
                raise ValueError(items)
            return [int(x) for x in items]
        except (TypeError, ValueError):
            raise ConfigError(key, f"{value!r} is not a list of integers",
                              "give a list, e.g. [1, 2] in a TOML file, 1,2 with --set") from None
    if typing.get_origin(hint) is list:  # list[str]: a TOML list, or "a,b,c" from --set
        items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ConfigError(key, f"{value!r} is not a list of strings",
                              'give a list, e.g. ["0.5", "a", "0.5", "b"] in a TOML file, 0.5,a,0.5,b with --set')
        return items
    if hint == Switch:  # true, false (or what a bool takes: 1, yes, ...) or auto
        lowered = value.strip().lower() if isinstance(value, str) else value
        if lowered == AUTO or isinstance(lowered, bool):
            return lowered
        if lowered in _BOOLS:
            return _BOOLS[lowered]
        raise ConfigError(key, f"{value!r} is not true, false or auto", "choose true, false or auto")
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
    base = type(choices[0]) if choices else hint
    if isinstance(value, str) and base is not str:
        text = value.strip()
        try:
            if base is bool:
                if text.lower() not in _BOOLS:
                    raise ValueError(text)
                value = _BOOLS[text.lower()]
            elif base is int:
                value = int(text)
            elif base is float:
                value = float(text)
        except ValueError:
            raise ConfigError(key, f"'{value}' is not {a_or_an(base.__name__)}",
                              f"give {a_or_an(base.__name__)} value") from None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(key, f"{value!r} has type {type(value).__name__}, expected {base.__name__}",
                          f"choose one of {', '.join(map(str, choices))}" if choices else f"give {a_or_an(base.__name__)} value")
    if base is float and not math.isfinite(value):  # no setting means anything at inf or nan
        raise ConfigError(key, f"{value} is not a finite number", "give a finite value")
    if (key, value) in REMOVED_VALUES:
        raise ConfigError(key, REMOVED_VALUES[key, value], f"choose one of {', '.join(map(str, choices))}")
    if choices and value not in choices:
        names = ", ".join(map(str, choices))
        raise ConfigError(key, f"'{value}' is not one of {names}", f"choose one of {names}")
    return value


def build_config(values: dict[str, dict[str, Any]]) -> Config:
    """Build a checked :class:`Config` from ``{section: {key: value}}`` (strings are parsed)."""
    sections = {}
    for name, table in values.items():
        if name not in SECTIONS:
            raise _unknown(name, list(table) if isinstance(table, dict) else [])
        if not isinstance(table, dict):
            raise ConfigError(name, "is not a table", f"write it as [{name}] with keys under it")
    for name, cls in SECTIONS.items():
        table = values.get(name, {})
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in table.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                if _asks_for_nothing(dotted, value):
                    continue
                raise _unknown(dotted)
            kwargs[key] = _coerce(dotted, value, hints[key])
        sections[name] = cls(**kwargs)
    return Config(**sections)


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """``["model.hidden=256", ...]`` -> ``{"model": {"hidden": "256"}}`` (values parsed later)."""
    out: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(item, "an override must look like section.key=value",
                              "for example --set parallel.tp=2")
        out.setdefault(section, {})[name] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (optional), apply ``section.key=value`` overrides, and check the result."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("--config", f"file '{path}' does not exist", "give the path of a TOML file") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError("--config", f"cannot read '{path}' ({e.strerror})", "give the path of a TOML file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"'{path}' is not valid TOML ({e})", "fix the file's syntax") from None
    for section, table in parse_overrides(list(overrides)).items():
        values.setdefault(section, {})
        if not isinstance(values[section], dict):
            raise ConfigError(section, "is not a table", f"write it as [{section}] with keys under it")
        values[section].update(table)
    return build_config(values)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}
