"""What the GPU microbenchmarks (tp_collectives.py, dp_overlap_contention.py,
grad_accumulate_probe.py) share: timing a callable on the GPU after every rank is ready, a
collective run beside compute on a second stream, torch's symmetric memory switched on for a
group, and NCCL user-buffer registration (tensors allocated from the backend's pool)."""

import torch
import torch.distributed as dist


def cuda_ms(run, reps: int) -> float:
    """Milliseconds per call of ``run`` on the GPU: one call to warm up, all ranks lined up (where
    there is a process group), then ``reps`` calls between CUDA events."""
    run()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def beside(collective, compute, stream: torch.cuda.Stream):
    """A callable running ``collective`` on ``stream`` while ``compute`` runs on the current
    stream, both done when it returns to the stream: what an overlapped collective costs the
    work it overlaps."""
    def run():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            collective()
        compute()
        torch.cuda.current_stream().wait_stream(stream)
    return run


def enable_symm_mem(group: dist.ProcessGroup) -> str | None:
    """Switch symmetric memory on for ``group`` (newer torch does so on first use); the reason
    it is unavailable, or None."""
    try:
        from torch.distributed import _symmetric_memory as symm
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(group.group_name)
    except Exception as e:  # noqa: BLE001 - the caller reports it and measures the rest
        return repr(e)
    return None


class RegisteredBuffers:
    """Tensors made by ``make()`` inside the NCCL backend's memory pool, which is then registered
    with NCCL (zero-copy collectives); ``release()`` deregisters it before the group goes."""

    def __init__(self, group: dist.ProcessGroup, make) -> None:
        self.backend = group._get_backend(torch.device("cuda"))
        self.pool = torch.cuda.MemPool(self.backend.mem_allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.tensors = make()
        self.backend.register_mem_pool(self.pool)

    def release(self) -> None:
        self.backend.deregister_mem_pool(self.pool)
        self.tensors = None
