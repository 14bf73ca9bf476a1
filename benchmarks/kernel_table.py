"""The top GPU kernels of a few training steps (torch.profiler), rank 0, for finding what a layout
spends its time on. Run like the trainer:
`torchrun --nproc-per-node N benchmarks/kernel_table.py [k=v ...]` (GPT-1.3B benchmark model)."""

import sys

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
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
if rank == 0:
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
torch.distributed.destroy_process_group()
