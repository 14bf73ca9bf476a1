"""Training speed of a benchmark model under tessera's own trainer, on synthetic tokens.

    python3 benchmarks/quick_train.py MODEL [section.key=value ...]
    NPROC=2 python3 benchmarks/quick_train.py gpt-1.3b parallel.tp=2 parallel.sequence_parallel=true

MODEL is a name in benchmarks/models/ (gpt-1.3b, llama-1b) or the path of a config TOML. It runs
``tessera train --config MODEL --nproc-per-node $NPROC`` for 12 steps (``train.steps=N`` changes
that) and prints, from the run's metrics.jsonl, the median over the steps after warm-up (the 4th
on) of tokens/s per GPU, model TFLOP/s per GPU and MFU (src/tessera/models/flops.py), the logging
rank's peak memory, every step's tokens/s (STEPS) and loss (LOSSES), and the RESULT line that
compare.py reads.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
WARMUP = 3  # steps left out of the medians: compilation, graph capture, allocator growth


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS.glob("*.toml"))


def model_config(model: str) -> Path:
    """The TOML of ``model``: a name in benchmarks/models/ or a path."""
    path = Path(model) if model.endswith(".toml") else MODELS / f"{model}.toml"
    if not path.is_file():
        raise SystemExit(f"unknown model {model!r}: choose from {', '.join(model_names())} or give a TOML path")
    return path


def summary(name: str, nproc: int, overrides: list[str], steps: list[dict]) -> list[str]:
    """The lines printed from the metrics of a run's steps (one dict per logged step)."""
    timed = steps[WARMUP:] or steps
    tps = statistics.median(m["tokens_per_s"] for m in timed) / nproc
    extra = f", {statistics.median(m['tflops_per_gpu'] for m in timed):.1f} TFLOP/s per GPU"
    if "mfu" in timed[-1]:
        extra += f", MFU {statistics.median(m['mfu'] for m in timed):.1%}"
    if "peak_mem_gib" in timed[-1]:
        extra += f", peak memory {timed[-1]['peak_mem_gib']:.1f} GiB (the logging rank)"
    return ["STEPS tokens/s per GPU: " + " ".join(f"{m['tokens_per_s'] / nproc:,.0f}" for m in steps),
            "LOSSES " + " ".join(f"{m['loss']:.5f}" for m in steps),  # two ways of running one model: one curve?
            f"RESULT {name} nproc={nproc} {' '.join(overrides)}: {tps:,.0f} tokens/s per GPU{extra}"]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt-1.3b"
    config, overrides = model_config(name), sys.argv[2:]
    nproc = int(os.environ.get("NPROC", "1"))
    out = tempfile.mkdtemp()
    sets = ["train.steps=12", "train.log_every=4", f"train.out_dir={out}", *overrides]
    command = [sys.executable, "-m", "tessera", "train", "--config", str(config), "--nproc-per-node", str(nproc)]
    # the checkout's src/ first: the GPU machine runs the working tree without installing it
    src = str(HERE.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    subprocess.run(command + [a for s in sets for a in ("--set", s)], check=True, env=env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    label = Path(name).stem if name.endswith(".toml") else name  # (gpt-1.3b has a dot of its own)
    print("\n".join(summary(label, nproc, overrides, steps)), flush=True)


if __name__ == "__main__":
    main()
