"""The host's time per forward of the benchmark model's layer stack (GPT-1.3B's 24 layers and its
code paths: fused weight gradients, tied head, loss) at tiny sizes, on the CPU: with the
arithmetic negligible, what is left is Python and dispatch, the time a GPU run's host needs to
launch a forward (pipeline_timeline.py showed hosts no faster than their GPU in forwards).
Prints the minimum and median over 15 rounds of 10 forwards.
`python benchmarks/host_forward.py [k=v ...]` (overrides as for quick_train.py)."""

import statistics
import sys
import time

import torch
from quick_train import MODELS  # benchmarks/ is on sys.path when a script here runs

from tessera.config import load_config
from tessera.tensor_parallel import RNGTracker
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed
from tessera.training.trainer import Stage, build_data_parallel

torch.set_num_threads(1)
sets = MODELS["gpt-1.3b"] + ["train.micro_batch=1", "train.global_batch=1", "train.dtype=fp32", "data.source=synthetic",
                             "model.hidden=32", "model.heads=2", "model.seq_len=8", "model.vocab_size=64",
                             "train.grad_accum_fusion=true", *sys.argv[1:]]
cfg = load_config(None, sets)
topo = Topology.build(tp=1, pp=1, dp=1)
stage = Stage(cfg, topo, RNGTracker.for_rank(1, 0, 0, topo.device))
build_data_parallel(stage, topo, cfg)  # its gradient hooks, as in training
batch = DataFeed(cfg, topo).next()[0]
model = stage.chunks[0]


def forward():
    return model(tokens=batch["tokens"], hidden=None, labels=batch["labels"], position_ids=None, document_ids=None)


for _ in range(10):
    forward()
rounds = []
for _ in range(15):
    start = time.perf_counter()
    for _ in range(10):
        forward()
    rounds.append((time.perf_counter() - start) / 10 * 1e3)
layers = cfg.model.layers
print(f"RESULT host time per forward ({layers} layers): min {min(rounds):.2f} ms, median "
      f"{statistics.median(rounds):.2f} ms ({statistics.median(rounds) / layers * 1e3:.0f} us per layer)")
