"""Gradient reductions over the data-parallel group, started now and finished later.

Each function launches its collective (asynchronously when asked) and returns a
:class:`Pending` whose ``wait()`` completes it, including any work that must follow the
collective (summing received pieces, copying into place).

Low-precision gradients are reduced with fp32 accumulation (Megatron's
reduce_scatter_with_fp32_accumulation): instead of a reduce-scatter that adds bf16 numbers in
bf16 inside the ring, an all-to-all sends every rank the dp pieces of its shard (the same bytes a
reduce-scatter moves) and the receiver adds them in fp32. Summing 8 or 64 bf16 gradients in bf16
loses bits at each hop; this loses none beyond the inputs' own rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.tensor_parallel.mappings import all_gather_single, reduce_scatter_single


class Pending:
    """A launched collective; ``wait()`` finishes it (once)."""

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None):
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.then is not None:
            then, self.then = self.then, None
            then()


def shard(flat: Tensor, rank: int, size: int) -> Tensor:
    """``rank``'s contiguous 1/size of a 1-D tensor whose length ``size`` divides."""
    n = flat.numel() // size
    return flat[rank * n:(rank + 1) * n]


def reduce_scatter(grad: Tensor, out: Tensor, group: dist.ProcessGroup, *, accumulate: bool,
                   async_op: bool) -> Pending:
    """Sum ``grad`` (1-D, flat) over ``group``; this rank's shard of the sum goes to ``out`` (fp32),
    added to it when ``accumulate``, else written. bf16/fp16 ``grad`` is summed in fp32."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if grad.dtype != torch.float32:
        pieces = torch.empty_like(grad)
        work = dist.all_to_all_single(pieces, grad, group=group, async_op=async_op)

        def add_in_fp32() -> None:  # written: one pass from the bf16 pieces to the fp32 sum
            if accumulate:
                out.add_(pieces.view(size, -1).sum(0, dtype=torch.float32))
            else:
                torch.sum(pieces.view(size, -1), 0, dtype=torch.float32, out=out)
        return Pending(work, add_in_fp32)
    mine = shard(grad, rank, size)
    if not accumulate and out.data_ptr() == mine.data_ptr():  # in place: out is this rank's piece
        return Pending(reduce_scatter_single(out, grad, group=group, async_op=async_op))
    tmp = torch.empty_like(mine)
    work = reduce_scatter_single(tmp, grad, group=group, async_op=async_op)
    return Pending(work, lambda: out.add_(tmp) if accumulate else out.copy_(tmp))


def all_reduce(grad: Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Pending:
    """Sum ``grad`` (1-D, flat) over ``group`` in place. fp32: one all-reduce. bf16/fp16: the
    fp32-accumulating reduce-scatter, then an all-gather of the summed shards (a ring all-reduce
    is these two halves; the second starts when the first is waited for)."""
    if grad.dtype == torch.float32:
        return Pending(dist.all_reduce(grad, group=group, async_op=async_op))
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = shard(grad, rank, size)
    summed = torch.empty(mine.numel(), dtype=torch.float32, device=grad.device)
    first = reduce_scatter(grad, summed, group, accumulate=False, async_op=async_op)

    def gather() -> None:
        first.wait()
        mine.copy_(summed)
        all_gather_single(grad, mine, group=group)
    return Pending(None, gather)


def all_gather(flat: Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Pending:
    """Fill every rank's shard of ``flat`` (1-D) from its owner, in place."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return Pending(all_gather_single(flat, shard(flat, rank, size), group=group, async_op=async_op))
