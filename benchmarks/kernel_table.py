"""The top GPU kernels of a few training steps (torch.profiler) on rank 0, and on every rank how
much of a step its GPU is busy (and with NCCL) against the wall time, for finding what a layout
spends its time on (a pipeline stage that idles shows there). Run like the trainer:
`torchrun --nproc-per-node N benchmarks/kernel_table.py [k=v ...]` (GPT-1.3B benchmark model)."""

import csv
import gzip
import json
import os
import sys
import time

import torch
from bench_setup import build
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tessera.training.step import train_step

b = build(sys.argv[1:])
rank, topo, stage, dp, opt, data = b.rank, b.topo, b.stage, b.dp, b.opt, b.data


def step():
    mbs = data.next()
    train_step(opt, mbs, topo, stage.executor(len(mbs)), dp, clip_grad=1.0, scaler=None)


for _ in range(3):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(3):
    step()
torch.cuda.synchronize()
plain = (time.perf_counter() - t0) / 3
t0 = time.perf_counter()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
wall = (time.perf_counter() - t0) / 2
if rank == 0:
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Time covered by the (start, end) spans in µs, overlaps counted once, in ms."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def intersect_ms(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time in ms during which some span of ``a`` and some span of ``b`` both run."""
    return union_ms(a) + union_ms(b) - union_ms(a + b)


# the kernels with their streams, from the profiler's own trace (FunctionEvent has no stream)
trace = f"/tmp/kernel_table_trace_{rank}.json"
prof.export_chrome_trace(trace)
with open(trace) as f:
    events = json.load(f)["traceEvents"]
kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
rows = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream", -1), e["name"]) for e in kernels]
spans = [(a, b) for a, b, _, _ in rows]
nccl = [(a, b) for a, b, _, n in rows if "nccl" in n.lower()]
compute = [(a, b) for a, b, _, n in rows if "nccl" not in n.lower()]
streams = sorted({s for _, _, s, _ in rows})
# every rank: how much of the step its GPU computes, communicates, and idles (wall is unprofiled);
# how much of its NCCL time runs beside compute (on another stream: overlapped communication)
print(f"SUMMARY rank {rank} {' '.join(sys.argv[1:])}: wall {plain * 1e3:.0f} ms/step ({wall * 1e3:.0f} profiled), "
      f"GPU busy {union_ms(spans) / 2:.0f} ms/step (kernels on any stream), of which NCCL {union_ms(nccl) / 2:.0f} ms, "
      f"compute (non-NCCL kernels) {union_ms(compute) / 2:.0f} ms, NCCL beside compute "
      f"{intersect_ms(nccl, compute) / 2:.0f} ms, {len(rows) // 2} kernels/step", flush=True)
for s in streams:
    mine = [(a, b, n) for a, b, t, n in rows if t == s]
    own_nccl = [(a, b) for a, b, n in mine if "nccl" in n.lower()]
    own_compute = [(a, b) for a, b, n in mine if "nccl" not in n.lower()]
    print(f"STREAM rank {rank} stream {s}: {len(mine) // 2} kernels/step, NCCL {union_ms(own_nccl) / 2:.1f} ms/step, "
          f"compute {union_ms(own_compute) / 2:.1f} ms/step", flush=True)
# every kernel (start and end in µs from the first, stream, name) for reading offline
# (benchmarks/kernel_timeline.py)
out = os.environ.get("OUT")
if out:
    t0 = min(a for a, _ in spans)
    with gzip.open(f"{out}/kernels_{os.environ.get('KT_TAG', 'run')}_rank{rank}.csv.gz", "wt") as f:
        csv.writer(f).writerows((f"{a - t0:.1f}", f"{b - t0:.1f}", s, n[:120]) for a, b, s, n in rows)
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
