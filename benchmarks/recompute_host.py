"""The host's time of full recomputation: a tiny GPT whose step is all Python and dispatch.

    python3 benchmarks/recompute_host.py [--rounds 8] [--device cpu|cuda]

Three runs of one model, alternated round by round (a busy machine slows all three alike): no
recomputation, ``train.recompute=full`` through tessera's one-node recompute
(tensor_parallel/random.py's ``_Recomputed``), and the same through torch.utils.checkpoint's
non-reentrant mode (what tessera used before). Prints the median of the process's CPU time per
step (``time.process_time``: other processes' load counts less than in wall time), 24 layers x
8 micro-batches a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
import torch.utils.checkpoint as checkpoint  # noqa: E402

import tessera.tensor_parallel.random as rng  # noqa: E402
from bench_setup import setup  # noqa: E402

TINY = ["model.layers=24", "model.hidden=32", "model.heads=2", "model.seq_len=16", "model.vocab_size=64",
        "train.dtype=fp32", "train.micro_batch=1", "train.global_batch=8"]


class TorchCheckpoint:
    """torch's non-reentrant checkpoint in the place of tessera's node (no dropout here: no streams)."""

    @staticmethod
    def apply(fn, tracker, x, *rest):
        return checkpoint.checkpoint(fn, x, *rest, use_reentrant=False)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sets = ["gpt-1.3b", *TINY, f"train.device={args.device}"]
    plain, full = setup(sets), setup([*sets, "train.recompute=full"])
    tessera_node = rng._Recomputed
    runs = {"none": (plain, tessera_node), "full, tessera's node": (full, tessera_node),
            "full, torch.utils.checkpoint": (full, TorchCheckpoint)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for _ in range(args.rounds):
            for name, (bench, node) in runs.items():
                rng._Recomputed = node
                bench.step()  # (a warm-up each round: the other run's state leaves the caches)
                began = time.process_time()
                for _ in range(args.steps):
                    _, result = bench.step()
                    float(result.loss)
                times[name].append((time.process_time() - began) / args.steps)
    finally:
        rng._Recomputed = tessera_node
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:<30} {medians[name] * 1e3:8.1f} ms a step   (rounds: {' '.join(f'{x * 1e3:.0f}' for x in t)})")
    base = medians["none"]
    for name in list(runs)[1:]:
        print(f"{name}: recomputation adds {(medians[name] - base) * 1e3:.0f} ms a step")
    return medians


if __name__ == "__main__":
    main()
