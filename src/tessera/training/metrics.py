"""Per-step metrics: one JSON object per line in ``metrics.jsonl`` and a readable console line.

Only one rank logs (the one holding the loss: last pipeline stage, tp and dp rank 0); the
others get a :class:`NullLogger`.

A run never appends to an earlier run's file: a ``metrics.jsonl`` already in ``out_dir`` is
renamed ``metrics.N.jsonl`` (the first free N) and said so. Non-finite values (a NaN loss, a
skipped fp16 step's gradient norm) are written as ``null``, which every JSON reader accepts.

A run holds ``out_dir/.tessera.lock`` (an exclusive ``flock``, released when the logger closes
or the process ends) while it writes there: a second run into the same ``out_dir`` is refused
while the first runs (it would rename the first's file, and their lines would interleave). The
file stays open for the whole run, so nothing that renames it moves the run's later lines.

With ``train.tensorboard`` the same figures also go to TensorBoard (:class:`TensorBoardScalars`),
one folder per run: ``out_dir/tensorboard/run-N``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import IO

from tessera.config import ConfigError

LOCK_NAME = ".tessera.lock"
CHECKPOINT_LOCK_NAME = ".tessera-checkpoints.lock"
TENSORBOARD_DIR = "tensorboard"


def lock_out_dir(out_dir: str | Path, key: str = "train.out_dir", name: str = LOCK_NAME) -> IO[str]:
    """Take ``out_dir``'s run lock (creating the folder); the open lock file, to close when done.
    Held by another run: a ConfigError naming ``key`` and the holder (its host and pid). A file
    system without ``flock`` (some network mounts) runs unlocked. (``checkpoint.dir`` has a lock
    of its own name: the same folder may be both, and two locks of one file in one process
    would conflict.)"""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        f = open(out_dir / name, "a+")
    except OSError as e:  # (a read-only or pseudo file system, no permission, a file in the way)
        raise ConfigError(key, f"cannot make {out_dir} a folder this run writes in ({e.strerror or e})",
                          "give a directory you can write", rank_local=True) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise ConfigError(key, f"{out_dir} is in use by another run{f' ({holder})' if holder else ''}",
                          f"wait for it to end, or choose another {key}", rank_local=True) from None
    except OSError:
        return f
    f.seek(0)
    f.truncate()
    f.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    f.flush()
    return f


def check_out_dir_free(out_dir: str | Path, key: str = "train.out_dir", name: str = LOCK_NAME) -> None:
    """Refuse an ``out_dir`` another run holds (the launcher's early check; the run itself then
    takes the lock)."""
    if (Path(out_dir) / name).exists():
        lock_out_dir(out_dir, key, name).close()


class NullLogger:
    def log(self, metrics: dict) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def print_last(self) -> None:
        pass

    def close(self) -> None:
        pass


def config_toml(sections: dict[str, dict]) -> str:
    """A resolved configuration (``config.to_dict``) as TOML that ``--config`` reads back: its
    values are strings, numbers, booleans and lists of strings, whose JSON spelling is TOML's."""
    return "".join(f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items()) + "\n"
                   for name, table in sections.items())


def check_tensorboard() -> None:
    """Refuse ``train.tensorboard=true`` where torch's TensorBoard writer cannot load (the
    ``tensorboard`` package is missing), before any work starts."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as e:
        raise ConfigError("train.tensorboard", f"true, but torch.utils.tensorboard cannot load ({e})",
                          "pip install tensorboard, or set train.tensorboard=false") from None


class TensorBoardScalars:
    """Every numeric metric of a step as a TensorBoard scalar at that step: ``train/loss``,
    ``train/lr``, ... and the validation figures as ``valid/loss`` and ``valid/ppl``. Booleans
    (``skipped``) are written as 0/1; None and non-finite values (a NaN loss, an fp16 skipped
    step's infinite gradient norm) are left out, as metrics.jsonl writes them as null."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self._writer = SummaryWriter(str(folder))

    def log(self, metrics: dict) -> None:
        for key, value in metrics.items():
            if key == "step" or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            tag = "valid/" + key.removeprefix("valid_") if key.startswith("valid_") else "train/" + key
            self._writer.add_scalar(tag, float(value), metrics["step"])

    def close(self) -> None:
        self._writer.close()  # (flushes what is pending)


def tensorboard_run(out_dir: Path) -> Path:
    """``out_dir/tensorboard/run-N``, N the first number no earlier run's files hold: the one
    under which this run's metrics.jsonl and config.toml are kept aside when a later run starts."""
    n = 1
    while any(path.exists() for path in (out_dir / f"metrics.{n}.jsonl", out_dir / f"config.{n}.toml",
                                         out_dir / TENSORBOARD_DIR / f"run-{n}")):
        n += 1
    return out_dir / TENSORBOARD_DIR / f"run-{n}"


class JsonlLogger:
    """Writes ``out_dir/metrics.jsonl`` (and, given ``config``, the run's resolved configuration
    as ``out_dir/config.toml``, which ``--config`` reads back); an earlier run's pair is kept
    aside as ``metrics.N.jsonl`` and ``config.N.toml``. ``tensorboard``: also every step's
    figures as TensorBoard scalars, in a folder of this run's own (:func:`tensorboard_run`)."""

    def __init__(self, out_dir: str | Path, log_every: int, stream=None, config: dict | None = None,
                 tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.log_every, self.stream = log_every, stream
        self._lock = lock_out_dir(out_dir)
        try:
            settings = self.path.with_name("config.toml")
            if (self.path.exists() and self.path.stat().st_size) or settings.exists():
                n = 1
                while (self.path.with_name(f"metrics.{n}.jsonl").exists()
                       or self.path.with_name(f"config.{n}.toml").exists()):
                    n += 1
                if self.path.exists() and self.path.stat().st_size:
                    aside = self.path.with_name(f"metrics.{n}.jsonl")
                    self.path.rename(aside)
                    self.print(f"tessera: {self.path} held an earlier run's metrics: kept as {aside}")
                if settings.exists():
                    settings.rename(settings.with_name(f"config.{n}.toml"))
            if config is not None:
                scratch = settings.with_name(f".config.toml.{os.getpid()}")
                scratch.write_text(config_toml(config))
                os.replace(scratch, settings)  # (whole or absent)
            self._file = self.path.open("a", buffering=1)  # line-buffered: each step's line written at once
            self._tensorboard = TensorBoardScalars(tensorboard_run(self.path.parent)) if tensorboard else None
            if self._tensorboard is not None:
                self.print(f"tessera: TensorBoard scalars in {self._tensorboard.folder} "
                           f"(view: tensorboard --logdir {self._tensorboard.folder.parent})")
        except BaseException:
            self._lock.close()
            raise
        self._last: dict | None = None  # the last step's metrics, and whether its line was printed
        self._last_printed = False

    def log(self, metrics: dict) -> None:
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        self._file.write(json.dumps(finite, allow_nan=False) + "\n")
        if self._tensorboard is not None:
            self._tensorboard.log(metrics)
        step = metrics["step"]
        self._last, self._last_printed = metrics, step % self.log_every == 0 or step == 1 or "valid_loss" in metrics
        if self._last_printed:
            self.print(format_line(metrics))

    def print_last(self) -> None:
        """The last step's line, where train.log_every skipped it (a run's end is worth a line)."""
        if self._last is not None and not self._last_printed:
            self.print(format_line(self._last))
            self._last_printed = True

    def print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)  # (sys.stdout as it is now: it may be replaced)

    def close(self) -> None:
        """Close the file (and flush TensorBoard's) and give the out_dir's lock back."""
        try:
            if self._tensorboard is not None:
                self._tensorboard.close()
        finally:
            self._file.close()
            self._lock.close()


def format_line(m: dict) -> str:
    line = (f"step {m['step']:>5} | loss {m['loss']:.4f} | grad norm {m['grad_norm']:.3f} | "
            f"lr {m['lr']:.2e} | {m['tokens_per_s']:,.0f} tok/s")
    if "loss_scale" in m:
        line += f" | scale {m['loss_scale']:g}"
    if m.get("skipped"):
        finite = isinstance(m["grad_norm"], float) and math.isfinite(m["grad_norm"])
        line += f" | step skipped ({'gradient norm spike' if finite else 'inf/nan gradients'})"
    if "valid_loss" in m:
        line += f" | valid loss {m['valid_loss']:.4f}"
    return line
