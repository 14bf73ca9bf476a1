"""The host's time per forward and backward of the benchmark model's layer stack (GPT-1.3B's 24
layers and its code paths: fused weight gradients, tied head, loss, data parallelism's gradient
hooks) at tiny sizes, on the CPU: with the arithmetic negligible, what is left is Python and
dispatch, the time a GPU run's host needs to launch them (pipeline_timeline.py showed hosts no
faster than their GPU in forwards, and at pp=2 slower than it in the I steps). Prints the
minimum and median over 15 rounds of 10 of: a forward (F), a whole backward (B), and the split
backward of the zero-bubble schedules: I (the weight GEMMs filed) and W (the filed GEMMs run).
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
data_parallel, _ = build_data_parallel(stage, topo, cfg)  # its gradient hooks, as in training
data_parallel.start_step(10**9)  # (no bucket ever complete: nothing reduced, every round counts the same)
batch = DataFeed(cfg, topo).next()[0]
model = stage.chunks[0]


def forward():
    return model(tokens=batch["tokens"], hidden=None, labels=batch["labels"], position_ids=None, document_ids=None)


store = stage.wgrad_store


def loss():
    out = forward()
    return out if out.dim() == 0 else out.sum()


def backward():
    loss().backward()


def backward_input(keep: bool = False):  # the I step: the weight-gradient GEMMs filed under a key
    with store.defer("mb"):
        loss().backward()
    if not keep:
        store.pending.pop("mb")  # (dropped unrun)


def split():  # I then W
    backward_input(keep=True)
    store.run("mb")


def time_rounds(fn) -> list[float]:
    for _ in range(5):
        fn()
    rounds = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        rounds.append((time.perf_counter() - start) / 10 * 1e3)
    return rounds


layers = cfg.model.layers
times = {"F": time_rounds(forward), "F+B": time_rounds(backward), "F+I": time_rounds(backward_input),
         "F+I+W": time_rounds(split)}
for name, rounds in times.items():
    print(f"RESULT host time per {name} ({layers} layers): min {min(rounds):.2f} ms, median "
          f"{statistics.median(rounds):.2f} ms ({statistics.median(rounds) / layers * 1e3:.0f} us per layer)")
