"""Time of one 16 MB all-gather (the size of a GPT-1.3B sequence-parallel all-gather at
micro-batch 2), alone on the GPUs: `torchrun --nproc-per-node 2 benchmarks/nccl_allgather.py`."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
r = dist.get_rank()
torch.cuda.set_device(r)
x = torch.ones(8 * 2**20, dtype=torch.bfloat16, device="cuda")
out = torch.empty(16 * 2**20, dtype=torch.bfloat16, device="cuda")
for _ in range(5):
    dist.all_gather_into_tensor(out, x)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(50):
    dist.all_gather_into_tensor(out, x)
torch.cuda.synchronize()
dt = (time.perf_counter() - t) / 50
if r == 0:
    print(f"all_gather 16 MB out: {dt * 1e6:.0f} us, {x.numel() * 2 / dt / 1e9:.0f} GB/s per rank sent")
dist.destroy_process_group()
