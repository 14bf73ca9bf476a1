"""What every section shares: the fast-path switch type and the error that names a key and its fix."""

from __future__ import annotations

from typing import Literal, Union

AUTO = "auto"
Switch = Union[bool, Literal["auto"]]  # a fast path: on, off, or chosen by the execution plan


class ConfigError(ValueError):
    """A configuration the run cannot start with. ``key`` is the dotted name at fault.
    ``rank_local``: found by one rank only (e.g. in its share of the data), so that rank must say
    it; the others' errors are found on every rank and said once, by rank 0."""

    def __init__(self, key: str, problem: str, fix: str, rank_local: bool = False):
        self.key, self.problem, self.fix, self.rank_local = key, problem, fix, rank_local
        super().__init__(f"config error: {key}: {problem} -> {fix}")


def check(ok: bool, key: str, problem: str, fix: str) -> None:
    """Raise ``ConfigError(key, problem, fix)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, problem, fix)


def check_local(key: str, path: str) -> None:
    """Refuse a URL (``s3://``, ``gs://``, ``file://``, ...) where tessera reads and writes local
    paths only: Python's file functions would take ``s3://bucket/x`` for a folder named ``s3:``."""
    if "://" in path:
        raise ConfigError(key, f"{path} is a URL; tessera reads and writes local (or mounted) paths there",
                          "give a local folder, or mount the bucket (gcsfuse, s3fs-fuse, ...) and give its path")


def resolve(switch: Switch, auto: bool) -> bool:
    """A switch's value: as given, or ``auto`` where it is ``"auto"``."""
    return auto if switch == AUTO else bool(switch)
