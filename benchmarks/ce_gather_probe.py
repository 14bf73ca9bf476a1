"""Whether zero 1/2's parameter all-gather on the copy engines (parallel.param_gather_copy_engine)
leaves the GEMMs beside it faster than NCCL's kernels do, through tessera's own code
(``Topology(copy_engine_gather=True)``, ``symmetric.SymmetricAllocator``,
``collectives.all_gather``). GPT-1.3B's bf16 parameters (1.3B, cut into 40M buckets) gathered at
dp=2 beside 60 GEMMs of its first forward's size, each way: the gathers alone, the GEMMs alone,
both on two streams, the GEMMs' slowdown; then whether the copy-engine gather delivered every
byte. Then the same for the last backward's fp32 gradient reduce-scatters (8 buckets of 40M), with
the buffers plain and in a symmetric window of the default-CTA dp communicator (NCCL's symmetric
kernels; copy engines cannot add). Run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL to see NCCL name the path it took.
`torchrun --nproc-per-node 2 benchmarks/ce_gather_probe.py [buckets]`."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from comm_bench import beside, cuda_ms

from tessera.distributed import collectives
from tessera.distributed.symmetric import SymmetricAllocator
from tessera.topology import Topology

rank = int(os.environ["RANK"])
device = torch.device("cuda", rank)
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
topo = Topology.build(dp=dist.get_world_size(), device=device, copy_engine_gather=True)
BUCKET, COUNT = 40_000_000, int(sys.argv[1]) if len(sys.argv) > 1 else 32  # 32 x 40M ~ GPT-1.3B
BUCKET -= BUCKET % topo.dp


def report(line: str) -> None:  # as it comes: a later hang must not lose what was measured
    if rank == 0:
        print("RESULT " + line, flush=True)


report(f"parameter all-gather contention, dp={topo.dp} ({torch.cuda.get_device_name()}), NCCL "
       f"{'.'.join(map(str, torch.cuda.nccl.version()))}, {COUNT} buckets of {BUCKET / 1e6:.0f}M bf16")
plain = torch.zeros(BUCKET * COUNT, dtype=torch.bfloat16, device=device)
allocator = SymmetricAllocator(topo.group("dp_gather"), device)  # holds the window registration
symmetric = allocator(BUCKET * COUNT, torch.bfloat16)
a = torch.randn(4096, 2048, dtype=torch.bfloat16, device=device)
b = torch.randn(2048, 8192, dtype=torch.bfloat16, device=device)
GEMMS = 60
comm = torch.cuda.Stream()


def gemms():
    for _ in range(GEMMS):
        a @ b


def gather(flat, group):
    def run():
        for i in range(COUNT):
            # on NCCL's stream, as DataParallel does: 2.28's copy-engine path fails on the default stream
            collectives.all_gather(flat[i * BUCKET:(i + 1) * BUCKET], group, async_op=True).wait()
    return run


def both(run_gather):  # the collective on its own stream beside the GEMMs
    return beside(run_gather, gemms, comm)


alone = cuda_ms(gemms, 3)
report(f"{GEMMS} GEMMs alone: {alone:.2f} ms")
for name, flat, group in (("NCCL kernels (dp group)", plain, topo.group("dp")),
                          ("copy engines (zero-CTA group, symmetric memory)", symmetric, topo.group("dp_gather"))):
    try:
        g, t = cuda_ms(gather(flat, group), 3), cuda_ms(both(gather(flat, group)), 3)
        report(f"{name}: gathers alone {g:.2f} ms ({flat.numel() * 2 / 1e9 / topo.dp * (topo.dp - 1) / g * 1e3:.0f} "
               f"GB/s received per rank); with the GEMMs {t:.2f} ms against {max(g, alone):.2f} if hidden "
               f"perfectly (GEMMs slowed by up to {100 * (t - alone) / alone:.1f} %)")
    except Exception as e:  # noqa: BLE001 - one way failing must not hide the other
        report(f"{name}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    dist.barrier()


def pattern(i: int, r: int, n: int) -> torch.Tensor:  # values that say whose shard and which bucket
    return torch.arange(n, device=device, dtype=torch.float32).remainder(251).add_(1000 * r + i).to(torch.bfloat16)


try:  # every byte: each rank fills its shards, the gather must bring the others'
    n = BUCKET // topo.dp
    for i in range(COUNT):
        collectives.shard(symmetric[i * BUCKET:(i + 1) * BUCKET], topo.dp_rank, topo.dp).copy_(pattern(i, topo.dp_rank, n))
    gather(symmetric, topo.group("dp_gather"))()
    torch.cuda.synchronize()
    exact = all(torch.equal(symmetric[i * BUCKET:(i + 1) * BUCKET].view(topo.dp, n)[r], pattern(i, r, n))
                for i in range(COUNT) for r in range(topo.dp))
    report(f"copy-engine gather exact: {exact}")
except Exception as e:  # noqa: BLE001
    report(f"copy-engine gather exactness: FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}")
del plain
dist.barrier()

RS = 8  # the last backward's gradient buckets, fp32, reduce-scattered in place into this rank's shard
grad_alloc = SymmetricAllocator(topo.group("dp"), device)
grads = {"plain buffers": torch.randn(BUCKET * RS, device=device),
         "symmetric window (dp group)": grad_alloc(BUCKET * RS, torch.float32)}
grads["symmetric window (dp group)"].copy_(grads["plain buffers"])


def reduce_scatter(flat):
    def run():
        for i in range(RS):
            bucket = flat[i * BUCKET:(i + 1) * BUCKET]
            collectives.reduce_scatter(bucket, collectives.shard(bucket, topo.dp_rank, topo.dp), topo.group("dp"),
                                       accumulate=False, async_op=True).wait()
    return run


for name, flat in grads.items():
    try:
        r, t = cuda_ms(reduce_scatter(flat), 3), cuda_ms(both(reduce_scatter(flat)), 3)
        report(f"fp32 reduce-scatter, {name}: {RS} buckets alone {r:.2f} ms; with the GEMMs {t:.2f} ms against "
               f"{max(r, alone):.2f} if hidden perfectly (GEMMs slowed by up to {100 * (t - alone) / alone:.1f} %)")
    except Exception as e:  # noqa: BLE001
        report(f"fp32 reduce-scatter, {name}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    dist.barrier()
dist.destroy_process_group()
