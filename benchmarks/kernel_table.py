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
from kernel_timeline import summary
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


# the kernels with their streams, from the profiler's own trace (FunctionEvent has no stream)
trace = f"/tmp/kernel_table_trace_{rank}.json"
prof.export_chrome_trace(trace)
with open(trace) as f:
    events = json.load(f)["traceEvents"]
kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
rows = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream", -1), e["name"]) for e in kernels]
streams = sorted({s for _, _, s, _ in rows})
# every rank: how much of the step its GPU computes, communicates, and idles (wall is unprofiled);
# how much of its NCCL time runs beside compute (on another stream: overlapped communication)
busy = summary(rows)
print(f"SUMMARY rank {rank} {' '.join(sys.argv[1:])}: wall {plain * 1e3:.0f} ms/step ({wall * 1e3:.0f} profiled), "
      f"GPU busy {busy['busy']:.0f} ms/step (kernels on any stream), of which NCCL {busy['nccl']:.0f} ms, "
      f"compute (non-NCCL kernels) {busy['compute']:.0f} ms, NCCL beside compute "
      f"{busy['beside']:.0f} ms, {len(rows) // 2} kernels/step", flush=True)
for s in streams:
    mine = summary([r for r in rows if r[2] == s])
    print(f"STREAM rank {rank} stream {s}: {sum(r[2] == s for r in rows) // 2} kernels/step, "
          f"NCCL {mine['nccl']:.1f} ms/step, compute {mine['compute']:.1f} ms/step", flush=True)
# every kernel (start and end in µs from the first, stream, name) for reading offline
# (benchmarks/kernel_timeline.py)
out = os.environ.get("OUT")
if out:
    t0 = min(r[0] for r in rows)
    with gzip.open(f"{out}/kernels_{os.environ.get('KT_TAG', 'run')}_rank{rank}.csv.gz", "wt") as f:
        csv.writer(f).writerows((f"{a - t0:.1f}", f"{b - t0:.1f}", s, n[:120]) for a, b, s, n in rows)
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
