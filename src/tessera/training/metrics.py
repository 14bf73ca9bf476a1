"""Per-step metrics: one JSON object per line in ``metrics.jsonl`` and a readable console line.

Only one rank logs (the one holding the loss: last pipeline stage, tp and dp rank 0); the
others get a :class:`NullLogger`.

A run never appends to an earlier run's file: a ``metrics.jsonl`` already in ``out_dir`` is
renamed ``metrics.N.jsonl`` (the first free N) and said so. Non-finite values (a NaN loss, a
skipped fp16 step's gradient norm) are written as ``null``, which every JSON reader accepts.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


class NullLogger:
    def log(self, metrics: dict) -> None:
        pass

    def print(self, text: str) -> None:
        pass


class JsonlLogger:
    def __init__(self, out_dir: str | Path, log_every: int, stream=sys.stdout):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log_every, self.stream = log_every, stream
        if self.path.exists() and self.path.stat().st_size:
            n = 1
            while (aside := self.path.with_name(f"metrics.{n}.jsonl")).exists():
                n += 1
            self.path.rename(aside)
            self.print(f"tessera: {self.path} held an earlier run's metrics: kept as {aside}")

    def log(self, metrics: dict) -> None:
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(finite, allow_nan=False) + "\n")
        step = metrics["step"]
        if step % self.log_every == 0 or step == 1:
            self.print(format_line(metrics))

    def print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def format_line(m: dict) -> str:
    line = (f"step {m['step']:>5} | loss {m['loss']:.4f} | grad norm {m['grad_norm']:.3f} | "
            f"lr {m['lr']:.2e} | {m['tokens_per_s']:,.0f} tok/s")
    if "loss_scale" in m:
        line += f" | scale {m['loss_scale']:g}"
    if m.get("skipped"):
        line += " | step skipped (inf/nan gradients)"
    return line
