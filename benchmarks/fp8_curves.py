"""Loss curves of one model on real text in bf16 and in fp8 (tensorwise, rowwise), and their plot.

    python3 benchmarks/fp8_curves.py run OUT.json            # on a GPU: three runs of 300 steps
    python3 benchmarks/fp8_curves.py plot OUT.json OUT.png   # anywhere with matplotlib

The model is a small GPT on the builtin corpus (the demo's text, byte tokens), every fast path at
``auto`` (fp8 layers compiled where auto compiles them); each run logs its loss every 5 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")
BASE = ["model.layers=6", "model.hidden=512", "model.heads=8", "model.seq_len=512", "model.vocab_size=256",
        "data.source=builtin", "train.dtype=bf16", "train.steps=300", "train.micro_batch=16",
        "train.global_batch=32", "optim.lr=1e-3", "optim.warmup=20", "train.log_every=5"]
RUNS = {"bf16": [], "fp8 tensorwise": ["train.fp8=tensorwise"], "fp8 rowwise": ["train.fp8=rowwise"]}


def run(path: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    curves = {}
    for name, extra in RUNS.items():
        out = tempfile.mkdtemp()
        sets = [*BASE, *extra, f"train.out_dir={out}"]
        subprocess.run([sys.executable, "-m", "tessera", "train", *(a for s in sets for a in ("--set", s))],
                       check=True, env=env)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
        curves[name] = [(m["step"], m["loss"]) for m in steps if "loss" in m]
        last = [loss for _, loss in curves[name][-4:]]
        print(f"{name}: mean loss of the last 20 steps {sum(last) / len(last):.4f}", flush=True)
    with open(path, "w") as f:
        json.dump({"config": BASE, "curves": curves}, f)


def plot(path: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        curves = json.load(f)["curves"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        ax.plot([s for s, _ in points], [loss for _, loss in points], label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("GPT 6x512 on the builtin corpus: bf16 and fp8")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "plot":
        plot(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
