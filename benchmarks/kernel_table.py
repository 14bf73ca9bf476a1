"""The top GPU kernels of a few training steps (torch.profiler), rank 0, for finding what a layout
spends its time on. Run like the trainer:
`torchrun --nproc-per-node N benchmarks/kernel_table.py [k=v ...]` (GPT-1.3B benchmark model)."""

import sys
import time

import torch
from bench_setup import build
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
    table = prof.key_averages()
    print(table.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
    kernels = [e for e in table if e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in kernels) / 2e6
    nccl = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / 2e6
    launches = sum(e.count for e in kernels) // 2
    # wall is with the profiler on (slower host side); busy counts overlapping streams twice
    print(f"SUMMARY {' '.join(sys.argv[1:])}: wall {plain * 1e3:.0f} ms/step ({wall * 1e3:.0f} profiled), kernel time "
          f"{busy * 1e3:.0f} ms/step of which NCCL {nccl * 1e3:.0f} ms, {launches} kernels/step")
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
