"""The sequence-parallel collectives of GPT-1.3B at tp=2 (micro-batch 2: an 8 MB bf16 shard,
16 MB gathered), alone on the GPUs, each way tessera could run them: NCCL (what the layers use),
eager and replayed from a CUDA graph (as graphed layers run them), NCCL with its buffers
registered (allocated from the backend's pool: ``register_mem_pool``), and torch's symmetric-memory
"low-contention" all-gather / reduce-scatter (copy-engine pulls between the GPUs' memories, no
NCCL kernel), eager and, where it captures, graphed; then the QKV all-gather + GEMM and the fc2
GEMM + reduce-scatter, NCCL then the GEMM against torch's fused symmetric-memory ops
(parallel.tp_async=true, measured slow eagerly in session 4), with the GEMMs alone for scale.
Prints microseconds per call.
`torchrun --nproc-per-node 2 benchmarks/tp_collectives.py [shard_mb]`."""

import datetime
import gc
import sys

import torch
import torch.distributed as dist
from comm_bench import RegisteredBuffers, cuda_ms, enable_symm_mem

rank = int(__import__("os").environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=45))
world = dist.get_world_size()
group = dist.group.WORLD
shard_mb = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
n = int(shard_mb * 2**20 / 2)  # bf16 elements per rank
shard = torch.randn(n // 4096, 4096, dtype=torch.bfloat16, device="cuda")
full = torch.randn(world * shard.shape[0], 4096, dtype=torch.bfloat16, device="cuda")
REPS = 24  # one layer's worth of collectives for a micro-batch is 8; a graph of 24 is 3 layers


def nccl_ag():
    out = torch.empty_like(full)
    dist.all_gather_into_tensor(out, shard, group=group)
    return out


def nccl_rs():
    out = torch.empty_like(shard)
    dist.reduce_scatter_tensor(out, full, group=group)
    return out


registered: list[RegisteredBuffers] = []  # inputs and outputs in NCCL's registered pool, once made


def register_buffers() -> None:
    registered.append(RegisteredBuffers(group, lambda: dict(
        shard=shard.clone(), full=full.clone(), ag_out=torch.empty_like(full), rs_out=torch.empty_like(shard))))


def nccl_ag_registered():
    t = registered[0].tensors
    dist.all_gather_into_tensor(t["ag_out"], t["shard"], group=group)
    return t["ag_out"]


def nccl_rs_registered():
    t = registered[0].tensors
    dist.reduce_scatter_tensor(t["rs_out"], t["full"], group=group)
    return t["rs_out"]


def symm_ag():
    out = torch.ops.symm_mem._low_contention_all_gather(shard, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def symm_rs():
    out = torch.ops.symm_mem._low_contention_reduce_scatter(full, "sum", group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


# the QKV projection's all-gather + GEMM and the MLP's GEMM + reduce-scatter of GPT-1.3B at tp=2 + SP
# (4096 tokens of hidden 2048): NCCL then the GEMM, against torch's fused symmetric-memory ops
# (parallel.tp_async=true), whose copies overlap the GEMM's chunks
tokens = 4096
x_shard = torch.randn(tokens // world, 2048, dtype=torch.bfloat16, device="cuda")
w_qkv = torch.randn(2048, 3 * 2048 // world, dtype=torch.bfloat16, device="cuda") * 0.02
y_local = torch.randn(tokens, 8192 // world, dtype=torch.bfloat16, device="cuda")
w_fc2 = torch.randn(8192 // world, 2048, dtype=torch.bfloat16, device="cuda") * 0.02


def gemm_qkv():
    return torch.cat([x_shard] * world) @ w_qkv


def nccl_ag_gemm():
    full = torch.empty(tokens, 2048, dtype=torch.bfloat16, device="cuda")
    dist.all_gather_into_tensor(full, x_shard, group=group)
    return full @ w_qkv


def symm_ag_gemm():
    _, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [w_qkv], 0, group.group_name)
    return out


def gemm_fc2():
    return y_local @ w_fc2


def nccl_gemm_rs():
    out = torch.empty(tokens // world, 2048, dtype=torch.bfloat16, device="cuda")
    dist.reduce_scatter_tensor(out, y_local @ w_fc2, group=group)
    return out


def symm_gemm_rs():
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(y_local, w_fc2, "sum", 0, group.group_name)


def timed(fn, graphed: bool) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graphed:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(REPS):
                    fn()
        finally:  # a failed capture_end skips the stream switch back
            torch.cuda.set_stream(torch.cuda.default_stream())
        run = graph.replay
    else:
        graph = None

        def run():
            for _ in range(REPS):
                fn()
    try:
        return cuda_ms(run, 10) * 1e3 / REPS
    finally:  # a graph holding NCCL work must be gone before the process group is destroyed
        del run, graph
        gc.collect()


def check():
    """The symmetric-memory results equal NCCL's. Every rank runs all four collectives before
    any comparison can raise, and the verdict is agreed, so no rank leaves the others waiting."""
    pairs = [(symm_ag(), nccl_ag(), 0.0), (symm_rs(), nccl_rs(), 1e-2)]
    bad = torch.tensor([float(not torch.allclose(a, b, rtol=tol, atol=tol)) for a, b, tol in pairs], device="cuda")
    dist.all_reduce(bad)
    if bad.any():
        raise AssertionError(f"symmetric memory differs from NCCL (all-gather, reduce-scatter): {bad.tolist()}")


if __name__ == "__main__":
    unavailable = enable_symm_mem(group)
    if unavailable:
        print(f"rank {rank}: symmetric memory unavailable: {unavailable}")

    def report(line: str) -> None:  # as it comes: a later hang must not lose what was measured
        if rank == 0:
            print("  " + line, flush=True)

    report(f"shard {shard_mb} MB bf16, {world} GPUs ({torch.cuda.get_device_name()}):")
    # a failed graph capture can spoil what runs after it: the symmetric-memory graphs run last
    runs = [("nccl all-gather", nccl_ag, False), ("nccl reduce-scatter", nccl_rs, False),
            ("nccl all-gather", nccl_ag, True), ("nccl reduce-scatter", nccl_rs, True),
            ("register NCCL buffers", register_buffers, None),
            ("nccl all-gather, registered buffers", nccl_ag_registered, False),
            ("nccl reduce-scatter, registered buffers", nccl_rs_registered, False),
            ("nccl all-gather, registered buffers", nccl_ag_registered, True),
            ("nccl reduce-scatter, registered buffers", nccl_rs_registered, True),
            ("symm-mem all-gather", symm_ag, False), ("symm-mem reduce-scatter", symm_rs, False),
            ("check: symm-mem results equal NCCL's", check, None),
            ("QKV GEMM alone", gemm_qkv, True), ("nccl all-gather + QKV GEMM", nccl_ag_gemm, True),
            ("fc2 GEMM alone", gemm_fc2, True), ("fc2 GEMM + nccl reduce-scatter", nccl_gemm_rs, True),
            ("fused all-gather + QKV GEMM (symm-mem)", symm_ag_gemm, False),
            ("fc2 GEMM + reduce-scatter fused (symm-mem)", symm_gemm_rs, False),
            ("fused all-gather + QKV GEMM (symm-mem)", symm_ag_gemm, True),
            ("fc2 GEMM + reduce-scatter fused (symm-mem)", symm_gemm_rs, True),
            ("symm-mem all-gather", symm_ag, True), ("symm-mem reduce-scatter", symm_rs, True)]
    for name, fn, graphed in runs:
        what = f"{name}{' (graph)' if graphed else ''}"
        torch.cuda.set_stream(torch.cuda.default_stream())
        try:
            if graphed is None:
                fn()
                report(f"RESULT {name}: done")
            else:
                us = timed(fn, graphed)
                rate = "" if "GEMM" in name else f" ({shard.numel() * 2 / us / 1e3:.0f} GB/s of shard per rank)"
                report(f"RESULT {what}: {us:.1f} us{rate}")
        except Exception as e:  # noqa: BLE001 - one way failing must not hide the others
            report(f"RESULT {what}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        dist.barrier()
    dist.barrier()
    for buffers in registered:
        buffers.release()
    dist.destroy_process_group()
