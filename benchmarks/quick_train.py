"""A first look at training speed on one GPU: tessera's trainer on a named model (synthetic data).

Usage: python benchmarks/quick_train.py [gpt-1.3b|llama-1b] [extra --set overrides...]
Prints tokens/s per GPU, model TFLOP/s per GPU and MFU (Megatron's FLOPs convention,
src/tessera/models/flops.py) and peak memory, from the trainer's metrics (medians of the steps
after warm-up).
The full harness, with peers in the same run, comes with the performance issue.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

MODELS = {
    "gpt-1.3b": ["model.family=gpt2", "model.layers=24", "model.hidden=2048", "model.heads=16",
                 "model.seq_len=2048", "model.vocab_size=50304", "model.tie_embeddings=true"],
    "llama-1b": ["model.family=llama", "model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8",
                 "model.ffn_hidden=8192", "model.seq_len=2048", "model.vocab_size=128256",
                 "model.tie_embeddings=false"],
}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt-1.3b"
    nproc = int(os.environ.get("NPROC", "1"))
    out = tempfile.mkdtemp()
    sets = MODELS[name] + ["train.micro_batch=2", "train.global_batch=16", "train.steps=12", "train.dtype=bf16",
                           "data.source=synthetic", "train.log_every=4", f"train.out_dir={out}", *sys.argv[2:]]
    command = [sys.executable, "-m", "tessera", "train", "--nproc-per-node", str(nproc)]
    # the checkout's src/ first, so it runs without an install or PYTHONPATH (session 12 lost a call to that)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    subprocess.run(command + [a for s in sets for a in ("--set", s)], check=True, env=env)
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    tps = statistics.median(m["tokens_per_s"] for m in steps[3:]) / nproc
    tflops = statistics.median(m["tflops_per_gpu"] for m in steps[3:])
    extra = f", {tflops:.1f} TFLOP/s per GPU"
    if "mfu" in steps[-1]:
        extra += f", MFU {statistics.median(m['mfu'] for m in steps[3:]):.1%}"
    if "peak_mem_gib" in steps[-1]:
        extra += f", peak memory {steps[-1]['peak_mem_gib']:.1f} GiB (the logging rank)"
    print("STEPS tokens/s per GPU:", " ".join(f"{m['tokens_per_s'] / nproc:,.0f}" for m in steps))
    if any("gc_ms" in m for m in steps):  # train.gc_interval: each collection's host time, after its step
        print("GC host ms after step:", " ".join(f"{m['step']}:{m['gc_ms']:.1f}" for m in steps if "gc_ms" in m))
    print("LOSSES", " ".join(f"{m['loss']:.5f}" for m in steps))  # two ways of running one model: the same curve?
    print(f"RESULT {name} nproc={nproc} {' '.join(sys.argv[2:])}: {tps:,.0f} tokens/s per GPU{extra}")


if __name__ == "__main__":
    main()
