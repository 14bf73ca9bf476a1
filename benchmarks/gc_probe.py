"""Where a full garbage collection's time goes while GPT-1.3B trains (``train.gc_interval``: each
collection held the host ~270 ms on the GPU machine in sessions 18-19, with the heap frozen, where
on a CPU one takes ~0.1 ms and finds nothing to free).

Runs WARM steps, collects and freezes the heap (as training/gc_control.py does), then ROUNDS
rounds of: STEPS steps and a collection timed as the trainer's runs (the host ahead of the GPU),
then STEPS steps, a timed ``torch.cuda.synchronize()`` and a collection. Where the first is far
slower than the second, something the collection runs (a finalizer, a deallocation) waits for the
GPU; where both are slow, it is the host's own work. Each line also gives the collector's
counters before it ran (``gc.get_count()``), what it found unreachable and the objects it tracks
after. `torchrun --nproc-per-node 2 benchmarks/gc_probe.py parallel.zero=1 [k=v ...]`."""

import gc
import os
import sys
import time

import torch
from bench_setup import build

from tessera.training.step import train_step

b = build(sys.argv[1:])
rank, topo, dp, opt, data = b.rank, b.topo, b.dp, b.opt, b.data
executor = b.stage.executor(len(data.next()))
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
WARM, STEPS, ROUNDS = (int(os.environ.get(k, d)) for k, d in (("WARM", "4"), ("STEPS", "3"), ("ROUNDS", "3")))


def steps(n: int) -> None:
    for _ in range(n):
        train_step(opt, data.next(), topo, executor, dp, clip_grad=1.0, scaler=None)


steps(WARM)
gc.collect()
gc.freeze()
gc.disable()
for r in range(ROUNDS):
    for synced in (False, True):
        steps(STEPS)
        sync_ms = 0.0
        if synced:
            t0 = time.perf_counter()
            sync()
            sync_ms = (time.perf_counter() - t0) * 1e3
        counts = gc.get_count()
        t0 = time.perf_counter()
        found = gc.collect()
        ms = (time.perf_counter() - t0) * 1e3
        tracked = len(gc.get_objects())
        # one write, newline included: the ranks share stdout, and print's separate write of the
        # newline let two ranks' lines run together
        sys.stdout.write(f"GC rank {rank} round {r} {'after a sync' if synced else 'host ahead '}: collect "
                         f"{ms:.1f} ms{f' (the sync before it {sync_ms:.1f} ms)' if synced else ''}, counts before "
                         f"{counts}, found {found}, tracked after {tracked} (frozen {gc.get_freeze_count()})\n")
        sys.stdout.flush()
gc.unfreeze()
gc.enable()
for g in b.graphs:
    g.release()
torch.distributed.destroy_process_group()
