"""Buffers in NCCL symmetric memory: parameter buffers, so zero 1/2's parameter all-gather runs
on the GPUs' copy engines instead of their SMs (``parallel.param_gather_copy_engine``), and
gradient buffers, so NCCL can reduce them with its symmetric-memory kernels
(``parallel.grad_reduce_symmetric``: zero 0/1, fp32; fewer SMs, but SMs: copy engines cannot add).

Why: the overlapped all-gather of the updated parameters runs beside the step's first forward,
and an NCCL kernel takes SMs from its GEMMs (session 9 measured an overlapped dp collective
slowing the GEMMs beside it by up to 13.5 %). NCCL >= 2.28 can run an all-gather as copy-engine
transfers, using no SM, when (a) its communicator's CTA policy is ``NCCL_CTA_POLICY_ZERO`` and
(b) its buffers lie in a window registered with that communicator as symmetric memory
(``ncclCommWindowRegister``). torch's NCCL symmetric-memory backend does (b): tensors allocated
from its memory pool and ``rendezvous``'d with a group are registered with that group's
communicator. The recipe is pytorch/pytorch#188697; torch's own FSDP RFC (#176418) does the same.

NCCL takes the copy-engine path only where it can: one node, a CUDA driver with the virtual
memory APIs NCCL's symmetric memory needs, both buffers in the window (the in-place gather's input
is a shard of its output, so they are), and in NCCL >= 2.29 transfers above its size threshold
(NCCL_SYM_CE_THRESHOLD); elsewhere it silently runs its kernels. `NCCL_DEBUG=INFO
NCCL_DEBUG_SUBSYS=INIT,COLL` shows which ("AllGather [Copy Engine]" when it took the copy
engines). Copy engines free the SMs, not the memory bandwidth: the gather still shares HBM
with the forward.

Only the gather moves to the copy engines: it runs on a dp communicator of its own
(``Topology``'s ``dp_gather`` group, zero-CTA), while gradient reduce-scatters, which copy
engines cannot do (they add), keep the default ``dp`` communicator. The bytes gathered are the
same, so a run gives the same results either way (GPU test). Gradient buffers registered with
the ``dp`` communicator (default CTA policy) let NCCL pick its symmetric-memory kernels for the
in-place reduce-scatter (zero=1) or all-reduce (zero=0); ``benchmarks/ce_gather_probe.py``
measures whether they slow the backward's GEMMs less.

Side effect, said here because tessera keeps no hidden global state otherwise: torch's choice of
symmetric-memory backend is per process (``set_backend("NCCL")``), so this cannot share a process
with ``parallel.tp_async=true`` (whose fused ops use torch's CUDA symmetric-memory backend);
the config refuses that pair.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor

MIN_NCCL = (2, 28)
_CTA_POLICY_ZERO = 2  # NCCL_CTA_POLICY_ZERO in nccl.h (0 default, 1 efficiency, 2 zero)


def unsupported(device: torch.device, copy_engine: bool = True) -> str | None:
    """Why buffers in NCCL symmetric memory cannot be used here, or None when they can;
    ``copy_engine``: for copy-engine collectives, which also need a CTA policy."""
    if device.type != "cuda":
        return f"they need CUDA GPUs and NCCL, this run is on {device.type}"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    version = torch.cuda.nccl.version()
    if tuple(version[:2]) < MIN_NCCL:
        return f"they need NCCL >= {MIN_NCCL[0]}.{MIN_NCCL[1]} (copy-engine collectives), this torch has {version}"
    if copy_engine and not hasattr(dist.ProcessGroupNCCL.Options().config, "cta_policy"):
        return "this torch cannot set an NCCL communicator's CTA policy (ProcessGroupNCCL.Options().config.cta_policy)"
    from torch.distributed import _symmetric_memory as symm
    if not hasattr(symm, "get_mem_pool"):
        return "this torch has no symmetric-memory pool (torch.distributed._symmetric_memory.get_mem_pool)"
    return None


def spans_nodes(ranks: list[int], local_world_size: int) -> bool:
    """Whether global ``ranks`` (one group's) sit on more than one node of ``local_world_size``
    ranks each (torchrun's numbering): torch registers a symmetric window by mapping every peer's
    memory, which NVLink gives inside one node only."""
    return len({r // local_world_size for r in ranks}) > 1


def zero_cta_options(timeout: datetime.timedelta | None = None) -> dist.ProcessGroupNCCL.Options:
    """Options for an NCCL communicator that uses no SM where it can (copy-engine collectives),
    with the group's ``timeout`` (else c10d warns that the options' differs)."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.cta_policy = getattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO", _CTA_POLICY_ZERO)
    if timeout is not None:
        options._timeout = timeout
    return options


class SymmetricAllocator:
    """Allocates zeroed flat tensors in NCCL symmetric memory registered with ``group`` (a window
    of that group's communicator): every rank of the group must allocate the same sizes in the
    same order (``rendezvous`` is collective)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, copy_engine: bool = True):
        why = unsupported(device, copy_engine)
        if why:
            raise RuntimeError(f"NCCL symmetric memory: {why}")
        if group is None:
            raise ValueError("SymmetricAllocator needs a process group of several ranks")
        from torch.distributed import _symmetric_memory as symm
        self._symm, self.group, self.device = symm, group, device
        symm.set_backend("NCCL")  # per process (module docstring)
        self.pool = symm.get_mem_pool(device)
        # a window registration as the communicator's first operation fails (pytorch#188567):
        # one small collective first
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        self.handles: list = []  # rendezvous handles (the registration lives with the allocation)

    def __call__(self, numel: int, dtype: torch.dtype) -> Tensor:
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            flat = torch.zeros(numel, dtype=dtype, device=self.device)
        self.handles.append(self._symm.rendezvous(flat, group=self.group))
        return flat
