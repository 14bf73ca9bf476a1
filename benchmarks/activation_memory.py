"""Activation memory per rank: the bytes autograd keeps for backward after one micro-batch's
forward, on any layout, on CPU processes (gloo) or where the config says.

    python3 benchmarks/activation_memory.py NPROC [section.key=value ...]
    python3 benchmarks/activation_memory.py 4 model.seq_len=16384 parallel.cp=4

Every storage the forward allocates and leaves alive (``models/activations.py``'s ``kept_bytes``:
tensors autograd saved, recomputed layers' inputs, what selective recomputation keeps) is counted
once, the loss left out, so the figure is what a layout keeps, not what the allocator happened to
hold: the quantity context parallelism (1/cp), sequence parallelism and recomputation
(``train.recompute=selective|full``) divide. Prints each rank's figure and the largest, as a
RESULT line.
"""

from __future__ import annotations

import sys

import torch

from tessera.config import load_config
from tessera.models.activations import kept_bytes
from tessera.testing import run_ranks

MODEL = ["model.family=llama", "model.layers=4", "model.hidden=256", "model.heads=4", "model.kv_heads=2",
         "model.vocab_size=256", "model.seq_len=4096", "train.micro_batch=1", "train.global_batch=1",
         "data.source=synthetic", "train.device=cpu"]


def _rank(rank: int, world: int, overrides: list[str]) -> int:
    from tessera.training.build import build, build_topology
    from tessera.training.data_feed import DataFeed
    from tessera.training.preflight import validate

    cfg = validate(load_config(None, MODEL + overrides), world)
    topo = build_topology(cfg, torch.device("cpu"))
    parts = build(cfg, topo)
    batch = DataFeed(cfg, topo).next()[0]
    chunk = parts.chunks[0]  # (pp=1: one stage holds the whole model)
    if cfg.parallel.pp > 1:
        raise SystemExit("pp > 1: measure one stage at a time is not done here; use parallel.pp=1")
    out = []
    kept = kept_bytes(lambda: out.append(chunk(tokens=batch["tokens"], labels=batch["labels"],
                                               position_ids=batch.get("position_ids"),
                                               document_ids=batch.get("document_ids"))))
    return kept - out[0].untyped_storage().nbytes()


def main() -> None:
    nproc, overrides = int(sys.argv[1]), sys.argv[2:]
    per_rank = run_ranks(_rank, nproc, overrides, timeout=1800)
    print("MiB per rank:", " ".join(f"{b / 2**20:.1f}" for b in per_rank))
    print(f"RESULT nproc={nproc} {' '.join(overrides)}: {max(per_rank) / 2**20:.1f} MiB of activations "
          f"on the largest rank")


if __name__ == "__main__":
    main()
