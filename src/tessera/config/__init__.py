"""Typed configuration: six sections, loaded from TOML, overridden with ``--set section.key=value``.

Every field has a default and a help string, which ``tessera config`` turns into
docs/configuration.md (:mod:`.reference`). Each section checks its own fields when it is built
(:mod:`.sections`); loading parses and type-checks values (:mod:`.loading`). Checks that need the
world size, the schedules, the data or the device live in ``training/preflight.py``. Every
failure is a :class:`ConfigError` naming the key and the fix. This package imports nothing else
of tessera.

A fast-path switch is ``bool | "auto"``: true or false as given, ``"auto"`` decided by the
execution plan (``training/plan.py``) from the shape, layout and device.
"""

from tessera.config.loading import a_or_an, build_config, load_config, parse_overrides, to_dict
from tessera.config.sections import (
    AUTO,
    SECTIONS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    Switch,
    TrainConfig,
    check,
    resolve,
)

__all__ = ["AUTO", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ModelConfig",
           "OptimConfig", "ParallelConfig", "Switch", "TrainConfig", "a_or_an", "build_config", "check",
           "load_config", "parse_overrides", "resolve", "to_dict"]
