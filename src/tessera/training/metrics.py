"""Per-step metrics: one JSON object per line in ``metrics.jsonl`` and a readable console line.

Only one rank logs (the one holding the loss: last pipeline stage, tp and dp rank 0); the
others get a :class:`NullLogger`.
"""

from __future__ import annotations

import json
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

    def log(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
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
