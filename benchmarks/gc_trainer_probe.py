"""What a ``train.gc_interval`` collection inside the trainer finds and where its time goes (on the
GPU machine each held the host ~250-280 ms in sessions 18-19, while benchmarks/gc_probe.py's
collections between bare ``train_step`` calls took 0.2 ms and found nothing: so the trainer's loop
makes garbage the bare steps do not).

Runs the trainer (``tessera train``'s own code, in this process) with the periodic collection
replaced by a measured one: every other collection first waits for the GPU (timed), then each
runs with ``gc.DEBUG_SAVEALL`` (the scan and the finalizers: what is unreachable is kept in
``gc.garbage``), counts the kinds of objects found, drops them and collects again (their
deallocation, timed apart), then once more (the scan alone); the first also freezes what
survived, as the trainer's does. Prints one ``GCPROBE`` line per collection and rank.
``torchrun --nproc-per-node 2 benchmarks/gc_trainer_probe.py --set train.gc_interval=4 --set ...``
(every ``tessera train`` option works)."""

import collections
import gc
import sys
import time

import torch

from tessera import cli
from tessera.training import gc_control

calls = [0]


def measured_step(self, step: int) -> float | None:
    if not (self.interval and (step + 1) % self.interval == 0):
        return None
    calls[0] += 1
    synced = calls[0] % 2 == 0
    t0 = time.perf_counter()
    if synced and torch.cuda.is_available():
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = gc.collect()
    gc.set_debug(0)
    t2 = time.perf_counter()
    kinds = collections.Counter(type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage)
    gc.garbage.clear()
    t3 = time.perf_counter()
    freed = gc.collect()
    t4 = time.perf_counter()
    gc.collect()  # nothing left to find: the scan alone
    t5 = time.perf_counter()
    tracked = len(gc.get_objects())  # what a full collection scans (not the frozen)
    if self._froze and not self._refrozen:  # as GarbageCollection.step: the first steps' survivors frozen
        gc.freeze()
        self._refrozen = True
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"GCPROBE rank {rank} after step {step + 1} {'after a sync' if synced else 'host ahead '}: "
          f"sync {(t1 - t0) * 1e3:.1f} ms, scan+finalizers {(t2 - t1) * 1e3:.1f} ms ({found} found), "
          f"drop {(t3 - t2) * 1e3:.1f} ms, free {(t4 - t3) * 1e3:.1f} ms ({freed}), scan alone "
          f"{(t5 - t4) * 1e3:.1f} ms; tracked {tracked}, frozen {gc.get_freeze_count()} (froze at the start: "
          f"{self._froze}); most found: {kinds.most_common(8)}", flush=True)
    return (t4 - t0) * 1e3


enter = gc_control.GarbageCollection.__enter__


def measured_enter(self):
    print(f"GCPROBE at the loop's start: frozen by others {gc.get_freeze_count()}, tracked {len(gc.get_objects())}",
          flush=True)
    return enter(self)


gc_control.GarbageCollection.step = measured_step
gc_control.GarbageCollection.__enter__ = measured_enter
sys.exit(cli.main(["train", *sys.argv[1:]]))
