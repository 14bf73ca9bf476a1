"""How much an overlapped gradient reduce-scatter slows the GEMMs it overlaps, each way tessera
could run it. At dp=2 the last micro-batch's backward runs while the fp32 gradient buckets are
reduce-scattered (and the first forward while the parameters are all-gathered); the session-2
profile put the compute about 1.4 ms per micro-batch slower there, most of what keeps dp=2 at
0.967 of one GPU (BENCHMARKS.md). Per way: the GEMMs alone, the reductions alone, both on two
streams at once, and the slowdown. Ways: NCCL (tessera's), NCCL with its buffers registered
(``register_mem_pool``), torch's symmetric-memory ``_low_contention_reduce_scatter`` (copy-engine
pulls, then a local sum); then cuBLASLt GEMMs with 0, 8, 16, 32 SMs carved out for NCCL
(parallel.dp_sm_carveout). Run NCCL_MAX_CTAS=... in front to try fewer NCCL blocks.
`torchrun --nproc-per-node 2 benchmarks/dp_overlap_contention.py [bucket_millions] [buckets]`."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from comm_bench import RegisteredBuffers, beside, cuda_ms, enable_symm_mem

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=45))
world, group = dist.get_world_size(), dist.group.WORLD
bucket = int(float(sys.argv[1]) * 1e6) if len(sys.argv) > 1 else 40_000_000  # parallel.bucket_size
count = int(sys.argv[2]) if len(sys.argv) > 2 else 8  # ~ a third of GPT-1.3B's gradients
bucket -= bucket % world
grads = [torch.randn(bucket, device="cuda") for _ in range(count)]
shards = [torch.empty(bucket // world, device="cuda") for _ in range(count)]
# the backward's GEMMs at GPT-1.3B scale: 4096 tokens x hidden 2048 x ffn 8192
a = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
b = torch.randn(2048, 8192, dtype=torch.bfloat16, device="cuda")
GEMMS = 60
comm = torch.cuda.Stream()


def gemms():
    for _ in range(GEMMS):
        a @ b


def nccl():
    for g, s in zip(grads, shards):
        dist.reduce_scatter_tensor(s, g, group=group)


registered = None  # RegisteredBuffers: copies of the gradients and shards in NCCL's registered pool


def nccl_registered():
    for g, s in zip(*registered.tensors):
        dist.reduce_scatter_tensor(s, g, group=group)


def low_contention():
    for g in grads:
        out = torch.ops.symm_mem._low_contention_reduce_scatter(g, "sum", group.group_name)
        torch.ops._c10d_functional.wait_tensor(out)


def ms(fn) -> float:
    return cuda_ms(fn, 3)


def both(reduce):  # the collective on its own stream beside the GEMMs
    return beside(reduce, gemms, comm)


def report(line: str) -> None:  # as it comes: a later hang must not lose what was measured
    if rank == 0:
        print("RESULT " + line, flush=True)


report(f"dp reduce-scatter contention, {world} GPUs ({torch.cuda.get_device_name()}), "
       f"NCCL_MAX_CTAS={os.environ.get('NCCL_MAX_CTAS', 'unset')}:")
unavailable = enable_symm_mem(group)
if unavailable:
    report(f"symmetric memory unavailable: {unavailable}")
alone = ms(gemms)
report(f"{GEMMS} GEMMs alone: {alone:.2f} ms")
for name, reduce in (("NCCL", nccl), ("NCCL, registered buffers", nccl_registered),
                     ("symm-mem low-contention", low_contention)):
    try:
        if reduce is nccl_registered:
            registered = RegisteredBuffers(group, lambda: ([g.clone() for g in grads],
                                                           [torch.empty_like(s) for s in shards]))
        r, t = ms(reduce), ms(both(reduce))
        report(f"{name}: {count} reduce-scatters of {bucket / 1e6:.0f}M fp32 alone {r:.2f} ms; with the GEMMs "
                     f"{t:.2f} ms against {max(r, alone):.2f} ms if hidden perfectly "
                     f"(GEMMs slowed by up to {100 * (t - alone) / alone:.1f} %)")
    except Exception as e:  # noqa: BLE001 - one way failing must not hide the others
        report(f"{name}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    dist.barrier()
# parallel.dp_sm_carveout: the GEMMs (cuBLASLt, which alone takes torch's carveout here) told to
# leave SMs free, so a persistent GEMM's blocks do not wait behind NCCL's (wave quantization)
torch.backends.cuda.preferred_blas_library("cublaslt")
for sms in (None, 8, 16, 32):
    torch._C._set_sm_carveout_experimental(sms)
    g, t = ms(gemms), ms(both(nccl))
    report(f"cuBLASLt, carveout {sms or 0} SMs: GEMMs alone {g:.2f} ms; with NCCL's reduce-scatters {t:.2f} ms "
           f"(+{100 * (t - g) / g:.1f} % over its GEMMs alone, +{100 * (t - alone) / alone:.1f} % over cuBLAS's)")
    dist.barrier()
torch._C._set_sm_carveout_experimental(None)
# captured under a carveout, replayed without one: is the SM count frozen into the graph (as
# parallel.tp_sm_carveout's graphed layers assume)? Slower alone than the graph captured without.
graphs = {}
for sms in (None, 32):
    torch._C._set_sm_carveout_experimental(sms)
    gemms()  # warm cuBLASLt's choice for this SM count before capturing
    torch.cuda.synchronize()
    graphs[sms] = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graphs[sms]):
        gemms()
torch._C._set_sm_carveout_experimental(None)
plain, carved = ms(graphs[None].replay), ms(graphs[32].replay)
report(f"GEMMs in a CUDA graph captured without a carveout {plain:.2f} ms, captured under 32 SMs carved out "
       f"and replayed without {carved:.2f} ms ({'frozen into the graph' if carved > 1.03 * plain else 'not kept'})")
torch.backends.cuda.preferred_blas_library("cublas")
dist.barrier()
if registered is not None:
    registered.release()
dist.destroy_process_group()
