"""Sequence-parallel matmuls fused with their collectives ("async TP", ``parallel.tp_async``).

Under sequence parallelism a column-parallel layer all-gathers its input along the sequence
before its GEMM, and a row-parallel layer reduce-scatters its GEMM's output; their backward
passes do the duals. Run one after the other, the collectives sit on the critical path (most of
what tp=2 loses, BENCHMARKS.md). torch's symmetric-memory ops
``symm_mem::fused_all_gather_matmul`` and ``symm_mem::fused_matmul_reduce_scatter`` cut the
matmul into per-rank chunks and move each chunk over NVLink with the copy engines while the
previous chunk multiplies, so the communication hides behind the GEMM and takes no SMs.

The two autograd functions here use them in both directions:

=========================  ================================  ======================================
layer                      forward                           backward (input grad; weight grad)
=========================  ================================  ======================================
column (``_AllGatherMM``)  all-gather x, x W^T               (g W) reduce-scattered; g^T x_full
row (``_MMReduceScatter``) (y W^T) reduce-scattered          all-gather g, g W; g_full^T y
=========================  ================================  ======================================

With ``parallel.tp_async=p2p`` the same two functions run as a ring of plain NCCL sends and
receives instead (the end of this file). With ``true``, on CUDA the symmetric-memory kernels run;
elsewhere torch's own reference implementations of the same ops (a functional collective, then
the matmul), which is what the CPU tests check the autograd wiring with. Weight gradients go through :func:`tessera.tensor_parallel.wgrad.weight_grad`
(zero-bubble deferral, gradient-accumulation fusion) like every other linear layer's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.tensor_parallel.wgrad import apply_linear, autocast_operands, weight_grad


@functools.cache
def _enable(group_name: str) -> None:
    from torch.distributed import _symmetric_memory as symm
    if hasattr(symm, "enable_symm_mem_for_group"):  # newer torch enables it on first use
        symm.enable_symm_mem_for_group(group_name)


def _all_gather_matmul(a_shard: Tensor, b: Tensor, group: dist.ProcessGroup,
                       backend: str = "symm_mem") -> tuple[Tensor, Tensor]:
    """(all-gather of ``a_shard`` along dim 0, that gathered tensor @ ``b``)."""
    if backend == "p2p":
        return ring_all_gather_matmul(a_shard, b, group)
    from torch.distributed import _symmetric_memory as symm
    if a_shard.is_cuda:
        _enable(group.group_name)
        full, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(a_shard.contiguous(), [b], 0, group.group_name)
    else:
        full, (out,) = symm._fused_all_gather_matmul_fallback(a_shard.contiguous(), [b], 0, group.group_name)
    return full, out


def _matmul_reduce_scatter(a: Tensor, b: Tensor, group: dist.ProcessGroup, backend: str = "symm_mem") -> Tensor:
    """(``a`` @ ``b``) summed over the group, this rank's slice of dim 0."""
    if backend == "p2p":
        return ring_matmul_reduce_scatter(a, b, group)
    from torch.distributed import _symmetric_memory as symm
    if a.is_cuda:
        _enable(group.group_name)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a.contiguous(), b, "sum", 0, group.group_name)
    return symm._fused_matmul_reduce_scatter_fallback(a.contiguous(), b, "sum", 0, group.group_name)


class _AllGatherMM(torch.autograd.Function):
    """Column-parallel layer under SP: ``y = all_gather(x) W^T + b``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, store, fuse, backend):
        x, w, b = autocast_operands(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            x_full, y = _all_gather_matmul(x, w.t(), group, backend)
            if b is not None:
                y = y + b
        ctx.save_for_backward(x_full, w)
        ctx.group, ctx.has_bias, ctx.weight, ctx.store, ctx.fuse = group, bias is not None, weight, store, fuse
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, grad):
        x_full, w = ctx.saved_tensors
        grad_x = _matmul_reduce_scatter(grad, w, ctx.group, ctx.backend)
        grad_w = weight_grad(ctx, grad, x_full) if ctx.needs_input_grad[1] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None


class _MMReduceScatter(torch.autograd.Function):
    """Row-parallel layer under SP: ``z = reduce_scatter(y W^T)`` (the bias is added after)."""

    @staticmethod
    def forward(ctx, y, weight, group, store, fuse, backend):
        y, w, _ = autocast_operands(y, weight, None)
        with torch.autocast(y.device.type, enabled=False):
            z = _matmul_reduce_scatter(y, w.t(), group, backend)
        ctx.save_for_backward(y, w)
        ctx.group, ctx.weight, ctx.store, ctx.fuse, ctx.backend = group, weight, store, fuse, backend
        return z

    @staticmethod
    def backward(ctx, grad):
        y, w = ctx.saved_tensors
        grad_full, grad_y = _all_gather_matmul(grad, w, ctx.group, ctx.backend)
        grad_w = weight_grad(ctx, grad_full, y) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None, None, None


def _backend(async_tp) -> str:
    """The layers' ``async_tp``: True (torch's symmetric-memory ops) or "p2p" (the ring below)."""
    if async_tp is True:
        return "symm_mem"
    if async_tp == "p2p":
        return "p2p"
    raise ValueError(f"async_tp={async_tp!r}: give True (symmetric memory) or 'p2p' (a ring of sends)")


def all_gather_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, group: dist.ProcessGroup,
                      store=None, fuse: bool = True, backend=True) -> Tensor:
    """x: [s/tp, b, in] (this rank's sequence slice) -> [s, b, out/tp]. ``backend``: the
    layers' ``async_tp`` (True: symmetric memory; "p2p": the ring below)."""
    return apply_linear(_AllGatherMM, store, x, weight, bias, group, store, fuse, _backend(backend))


def matmul_reduce_scatter(y: Tensor, weight: Tensor, group: dist.ProcessGroup, store=None,
                          fuse: bool = True, backend=True) -> Tensor:
    """y: [s, b, in/tp] -> [s/tp, b, out], summed over the group."""
    return apply_linear(_MMReduceScatter, store, y, weight, group, store, fuse, _backend(backend))


# -- the same two ops as a ring of point-to-point messages (``parallel.tp_async=p2p``) ---------
#
# Each step sends one sequence chunk to the next rank of the TP group and receives one from the
# previous (torch.distributed.batch_isend_irecv, NCCL's own streams on CUDA), while this rank
# multiplies the chunk it already has: n-1 steps for tp=n, the transfer of step k hidden behind
# the GEMM of step k. Plain NCCL send/receive, no symmetric memory.


def _ring_peers(group: dist.ProcessGroup) -> tuple[int, int, int, int]:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _exchange(send: Tensor, recv: Tensor, to: int, frm: int, group) -> list:
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)])


def _mm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    torch.mm(a.reshape(-1, a.shape[-1]), b, out=out.view(-1, b.shape[-1]))


def ring_all_gather_matmul(a_shard: Tensor, b: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """(all-gather of ``a_shard`` along dim 0, that @ ``b``): each step multiplies the chunk this
    rank holds while sending it on to the next rank and receiving the previous rank's. Every
    rank's shard must have the same shape (as under sequence parallelism)."""
    a_shard = a_shard.contiguous()
    n, r, to, frm = _ring_peers(group)
    m = a_shard.shape[0]
    full = a_shard.new_empty((n * m, *a_shard.shape[1:]))
    out = a_shard.new_empty((n * m, *a_shard.shape[1:-1], b.shape[-1]))
    full[r * m:(r + 1) * m].copy_(a_shard)
    have = r  # the chunk this rank holds and passes on next
    for step in range(n):
        pending = []
        if step < n - 1:
            got = (r - step - 1) % n
            pending = _exchange(full[have * m:(have + 1) * m], full[got * m:(got + 1) * m], to, frm, group)
        _mm_into(out[have * m:(have + 1) * m], full[have * m:(have + 1) * m], b)
        for work in pending:
            work.wait()
        if step < n - 1:
            have = got
    return full, out


def ring_matmul_reduce_scatter(a: Tensor, b: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(``a`` @ ``b``) summed over the group, this rank's slice of dim 0: the partial sum of
    chunk ``c`` starts on rank ``c + 1`` and travels the ring to its owner, each rank adding its
    own product while the previous partial sum is on the wire."""
    a = a.contiguous()
    n, r, to, frm = _ring_peers(group)
    if a.shape[0] % n:
        raise ValueError(f"reduce-scatter of dim 0 = {a.shape[0]} over {n} ranks: not divisible")
    m = a.shape[0] // n
    shape = (m, *a.shape[1:-1], b.shape[-1])
    acc = a.new_empty(shape)
    _mm_into(acc, a[((r - 1) % n) * m:((r - 1) % n + 1) * m], b)  # step 0: chunk r-1, fresh
    for step in range(1, n):
        chunk = (r - step - 1) % n
        incoming = a.new_empty(shape)
        pending = _exchange(acc, incoming, to, frm, group)
        mine = a.new_empty(shape)
        _mm_into(mine, a[chunk * m:(chunk + 1) * m], b)  # overlaps the transfer
        for work in pending:
            work.wait()
        acc = mine.add_(incoming)
    return acc
