"""Runs each tp=2 / dp=2 variant of tests/test_gpu.py::test_nccl_tensor_parallel_matches_one_gpu
one at a time and prints, as soon as it finishes, its losses against one GPU and the tail of its
stderr on failure (the pytest run holds every message until the end, which a timeout cuts off)."""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.seq_len=64", "train.steps=8",
        "train.micro_batch=2", "train.global_batch=8", "data.source=synthetic"]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
RUNS = {"tp2": SP + ["parallel.tp_comm_overlap=false"], "tp2-compiled": SP + ["train.compile=true"], "dp2": [],
        "tp2-async-compiled": SP + ["parallel.tp_async=true", "train.compile=true"],
        "tp2-async-p2p": SP + ["parallel.tp_async=p2p"], "tp2-overlap": SP + ["parallel.tp_comm_overlap=true"],
        "one-compiled": ["train.compile=true"]}  # one GPU, compiled: run on 1 process


def train(out, nproc, extra):
    sets = [*BASE, f"train.out_dir={out}", *extra]
    cmd = [sys.executable, "-m", "tessera", "train", "--nproc-per-node", str(nproc)]
    t = time.time()
    proc = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        return None, f"rc={proc.returncode} {time.time() - t:.0f}s\n{proc.stderr[-2500:]}"
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines], f"{time.time() - t:.0f}s " + (proc.stdout.splitlines() or [""])[0][:200]


def main():
    only = sys.argv[1:] or list(RUNS)
    tmp = Path(tempfile.mkdtemp())
    one, info = train(tmp / "one", 1, [])
    print("one", info, one, flush=True)
    for name in only:
        try:
            curve, info = train(tmp / name, 1 if name.startswith("one") else 2, RUNS[name])
        except subprocess.TimeoutExpired as e:
            print(name, "TIMEOUT", (e.stderr or b"")[-1500:], flush=True)
            continue
        if curve is None:
            print(name, "FAILED", info, flush=True)
            continue
        worst = max(abs(a - b) / abs(a) for a, b in zip(one, curve)) if len(curve) == len(one) else float("inf")
        print(name, "OK" if worst < 1e-4 else "MISMATCH", f"worst rel {worst:.2e}", info, curve, flush=True)


if __name__ == "__main__":
    main()
