"""Where a step's time varies from step to step, per rank (dp=2's spread, BENCHMARKS.md session 14:
GPT-1.3B's steps at 54.8-57.9k tokens/s per GPU where one GPU's stay within 2 %).

Runs steps as training does (each launched without waiting, its figures read after the next is
launched) and records, per step and rank, events at the step's launch, when backward is done
(finish_grad_sync entered), when the gradient reductions are done, and at the step's end (the
optimizer step and zero 1/2's parameter gathers launched). Prints per step and rank:
- step: the GPU time from the previous step's end to this one's;
- idle: of it, the GPU waiting for the host before this step's first work (the host fell behind);
- fb: forward and backward of the micro-batches (with the first forward's gather waits);
- sync: waiting for the reductions after backward;
- tail: gradient norm, optimizer, gather launches;
- lead: how far ahead of the GPU the host launched the step (about 0 where the GPU was waiting
  for it: then idle shows the wait).
A slow step whose extra time is in one rank's idle is the host's; in both ranks' fb, compute (or
communication contention); in sync, the reductions. On a CPU (gloo) the same runs with host
clocks (no lead, no idle), which is what the CPU test checks.

`torchrun --nproc-per-node 2 benchmarks/step_jitter.py parallel.zero=1 [k=v ...]` (STEPS=40 by
default, after 4 warm-up steps)."""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bench_setup import build

from tessera.training.gc_control import GarbageCollection
from tessera.training.step import train_step

b = build(sys.argv[1:])
rank, topo, stage, dp, opt, data = b.rank, b.topo, b.stage, b.dp, b.opt, b.data
cuda = topo.device.type == "cuda"
steps = int(os.environ.get("STEPS", "40"))


class Marks:
    """Named points of one step: a CUDA event (on a GPU) and the host's time at its record."""

    def __init__(self):
        self.points: dict[str, tuple] = {}

    def mark(self, name: str) -> None:
        event = None
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.points[name] = (event, time.perf_counter())


def run_step(marks: Marks):
    original = dp.finish_grad_sync

    def finish() -> None:
        marks.mark("backward_done")
        original()
        marks.mark("synced")

    dp.finish_grad_sync = finish
    try:
        marks.mark("begin")
        mbs = data.next()
        result = train_step(opt, mbs, topo, stage.executor(len(mbs)), dp, clip_grad=1.0, scaler=None)
        marks.mark("end")
    finally:
        dp.finish_grad_sync = original
    return result


for _ in range(4):
    run_step(Marks()).loss  # warm-up, read at once
if cuda:
    torch.cuda.synchronize()
if dist.is_initialized():
    dist.barrier()
anchor = torch.cuda.Event(enable_timing=True) if cuda else None
if cuda:
    anchor.record()
t0 = time.perf_counter()
records, previous = [], None
with GarbageCollection(b.cfg.train.gc_interval) as collector:  # as the trainer (train.gc_interval)
    for k in range(steps):
        marks = Marks()
        result = run_step(marks)
        if previous is not None:
            previous.loss  # read one step behind, as the trainer does
        previous = result
        records.append(marks)
        collector.step(k)
previous.loss
if cuda:
    torch.cuda.synchronize()


def gpu_ms(point) -> float:
    """ms from t0 on the GPU's clock (CUDA), or on the host's (CPU: the work ran as launched)."""
    event, host = point
    return anchor.elapsed_time(event) if cuda else (host - t0) * 1e3


rows = []
for k, m in enumerate(records):
    p = m.points
    end_before = gpu_ms(records[k - 1].points["end"]) if k else gpu_ms(p["begin"])
    begin, done, synced, end = (gpu_ms(p[n]) for n in ("begin", "backward_done", "synced", "end"))
    lead = begin - (p["begin"][1] - t0) * 1e3 if cuda else 0.0
    rows.append(dict(step=end - end_before, idle=max(0.0, begin - end_before), fb=done - begin, sync=synced - done,
                     tail=end - synced, lead=lead))
everyone = [None] * topo.world_size if dist.is_initialized() else [rows]
if dist.is_initialized():
    dist.all_gather_object(everyone, rows)
if rank == 0:
    names = ("step", "idle", "fb", "sync", "tail", "lead")
    print(f"JITTER {' '.join(sys.argv[1:])}: ms per step, ranks 0..{len(everyone) - 1}; " + ", ".join(names))
    for k in range(1, steps):  # the first has no previous end on the same clock
        cells = " | ".join(" ".join(f"{r[k][n]:6.1f}" for n in names) for r in everyone)
        print(f"  step {k:3d}: {cells}")
    for i, r in enumerate(everyone):
        times = [row["step"] for row in r[1:]]
        print(f"SUMMARY rank {i}: step median {statistics.median(times):.1f} ms, min {min(times):.1f}, "
              f"max {max(times):.1f}; medians idle {statistics.median(x['idle'] for x in r[1:]):.1f}, "
              f"fb {statistics.median(x['fb'] for x in r[1:]):.1f}, sync {statistics.median(x['sync'] for x in r[1:]):.1f}, "
              f"tail {statistics.median(x['tail'] for x in r[1:]):.1f}, lead min {min(x['lead'] for x in r[1:]):.1f}",
              flush=True)
for g in b.graphs:
    g.release()
if dist.is_initialized():
    dist.destroy_process_group()
