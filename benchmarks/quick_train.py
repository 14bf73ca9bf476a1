"""A first look at training speed on one GPU: tessera's trainer on a named model (synthetic data).

Usage: python benchmarks/quick_train.py [gpt-1.3b|llama-1b] [extra --set overrides...]
Prints tokens/s per GPU from the trainer's metrics (median of the steps after warm-up).
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
    subprocess.run(command + [a for s in sets for a in ("--set", s)], check=True)
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    tps = statistics.median(m["tokens_per_s"] for m in steps[3:]) / nproc
    print(f"RESULT {name} nproc={nproc} {' '.join(sys.argv[2:])}: {tps:,.0f} tokens/s per GPU")


if __name__ == "__main__":
    main()
