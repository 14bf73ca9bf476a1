"""The top GPU kernels of a few training steps (torch.profiler) on rank 0, and on every rank how
much of a step its GPU is busy (and with NCCL) against the wall time, for finding what a layout
spends its time on (a pipeline stage that idles shows there). Run like the trainer:
`torchrun --nproc-per-node N benchmarks/kernel_table.py [k=v ...]` (GPT-1.3B benchmark model)."""

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


kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
spans = [(e.time_range.start, e.time_range.end) for e in kernels]
nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
# every rank: how much of the step its GPU computes, communicates, and idles (wall is unprofiled)
print(f"SUMMARY rank {rank} {' '.join(sys.argv[1:])}: wall {plain * 1e3:.0f} ms/step ({wall * 1e3:.0f} profiled), "
      f"GPU busy {union_ms(spans) / 2:.0f} ms/step (kernels on any stream), of which NCCL {union_ms(nccl) / 2:.0f} ms, "
      f"compute (non-NCCL kernels) {union_ms(compute) / 2:.0f} ms, "
      f"{len(kernels) // 2} kernels/step", flush=True)
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
