"""Autograd-aware collectives over a tensor-parallel group: the f and g of the Megatron paper.

Each is a small ``torch.autograd.Function`` whose backward is the dual collective:

=============================  =====================  =====================
function                       forward                backward
=============================  =====================  =====================
copy_to_tp_region      (f)     identity               all-reduce
reduce_from_tp_region  (g)     all-reduce             identity
scatter_to_tp_region           split last dim         all-gather last dim
gather_from_tp_region          all-gather last dim    split last dim
scatter_to_sequence_region     split dim 0            all-gather dim 0
gather_from_sequence_region    all-gather dim 0       reduce-scatter dim 0
reduce_scatter_to_sequence_region  reduce-scatter dim 0   all-gather dim 0
=============================  =====================  =====================

Activations are laid out ``[seq, batch, hidden]``, so the sequence dimension is dim 0 and its
gathers and scatters are contiguous. Every function takes its group; a ``None`` group (or one
of size 1) makes it the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.tensor_parallel.wgrad import apply_linear, autocast_operands, weight_grad

Group = dist.ProcessGroup | None

# torch 2.13 renamed the tensor collectives (the old names warn); older releases only have those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


# -- the collectives as opaque ops for compiled code ----------------------------------------------
# Inside torch.compile, dynamo would rewrite the in-place c10d calls of the eager path into functional
# collectives that inductor schedules as asynchronous work with separate waits; compiled layers at
# tp > 1 with SP then drifted from one GPU on NCCL (BENCHMARKS.md, Fast-path safety). These ops keep
# each collective one opaque, synchronous call in the graph (as eager runs it: the compute stream
# waits for NCCL), so the compiler can neither reorder around it nor reuse its buffers early. The
# group travels by name, as torch's functional collectives pass it. (The overlapped column-parallel
# backward below still issues asynchronous c10d calls, which compiled code turns into functional
# collectives.)
def _resolve_process_group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group as resolve  # private: late

    return resolve(name)


def _all_gather_new(x: Tensor, group: dist.ProcessGroup, n: int) -> Tensor:
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_new(x: Tensor, group: dist.ProcessGroup, n: int) -> Tensor:
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_reduce_new(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # x is left alone: autograd may share it
    dist.all_reduce(out, group=group)
    return out


@torch.library.custom_op("tessera::all_gather_first", mutates_args=())
def _all_gather_first_op(x: Tensor, group_name: str, n: int) -> Tensor:
    return _all_gather_new(x, _resolve_process_group(group_name), n)


@_all_gather_first_op.register_fake
def _(x: Tensor, group_name: str, n: int) -> Tensor:
    return x.new_empty((n * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("tessera::reduce_scatter_first", mutates_args=())
def _reduce_scatter_first_op(x: Tensor, group_name: str, n: int) -> Tensor:
    return _reduce_scatter_new(x, _resolve_process_group(group_name), n)


@_reduce_scatter_first_op.register_fake
def _(x: Tensor, group_name: str, n: int) -> Tensor:
    return x.new_empty((x.shape[0] // n, *x.shape[1:]))


@torch.library.custom_op("tessera::all_reduce", mutates_args=())
def _all_reduce_op(x: Tensor, group_name: str) -> Tensor:
    return _all_reduce_new(x, _resolve_process_group(group_name))


@_all_reduce_op.register_fake
def _(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# -- plain (non-autograd) collectives: eager c10d calls, or the ops above when compiling ----------
def _all_reduce(x: Tensor, group: Group) -> Tensor:
    """The sum over the group, in a new tensor."""
    if group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return _all_reduce_op(x, group.group_name)
    return _all_reduce_new(x, group)


def _split_last(x: Tensor, group: Group) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the TP size {n}")
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: Tensor, group: Group) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    # The gather concatenates along dim 0; gather there and move the chunks to the last dim.
    out = _gather_first(x, group).view(n, *x.shape)
    return torch.cat(out.unbind(0), dim=-1)


def _split_first(x: Tensor, group: Group) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the TP size {n}")
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


def _gather_first(x: Tensor, group: Group) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if torch.compiler.is_compiling():
        return _all_gather_first_op(x, group.group_name, n)
    return _all_gather_new(x, group, n)


def _reduce_scatter_first(x: Tensor, group: Group) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the TP size {n}")
    if torch.compiler.is_compiling():
        return _reduce_scatter_first_op(x, group.group_name, n)
    return _reduce_scatter_new(x, group, n)


# -- autograd functions -------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None  # a new tensor: autograd may share grad with another branch


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tp_region(x: Tensor, group: Group) -> Tensor:
    """f: enter a TP region with a replicated input; gradients from all ranks are summed."""
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp_region(x: Tensor, group: Group) -> Tensor:
    """g: leave a TP region by summing the partial results of every rank."""
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tp_region(x: Tensor, group: Group) -> Tensor:
    """Keep this rank's slice of the last dimension."""
    return _ScatterToTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp_region(x: Tensor, group: Group) -> Tensor:
    """Concatenate every rank's slice of the last dimension."""
    return _GatherFromTP.apply(x, group) if group_size(group) > 1 else x


def scatter_to_sequence_region(x: Tensor, group: Group) -> Tensor:
    """Keep this rank's slice of the sequence (dim 0); backward all-gathers."""
    return _ScatterToSequence.apply(x, group) if group_size(group) > 1 else x


def gather_from_sequence_region(x: Tensor, group: Group, reduce_grad: bool = True) -> Tensor:
    """All-gather the sequence (dim 0). ``reduce_grad``: the consumer is TP-split (a column-parallel
    linear), so each rank holds a partial gradient and backward reduce-scatters; otherwise the
    gradient is already complete and backward just keeps this rank's slice."""
    return _GatherFromSequence.apply(x, group, reduce_grad) if group_size(group) > 1 else x


def reduce_scatter_to_sequence_region(x: Tensor, group: Group) -> Tensor:
    """Sum partial results and keep this rank's slice of the sequence (dim 0)."""
    return _ReduceScatterToSequence.apply(x, group) if group_size(group) > 1 else x


# -- a column-parallel linear with its input collective, overlapped in backward -------------------
class _ColumnParallelMatmul(torch.autograd.Function):
    """``y = enter(x) W^T + b`` where ``enter`` is the column layer's input collective: f (identity
    forward, all-reduce backward) or, under sequence parallelism, the all-gather along the
    sequence (reduce-scatter backward). One function, so that backward can start the input
    gradient's reduction asynchronously right after its GEMM and compute the weight gradient's
    GEMM while it travels (Megatron's "async tensor-model-parallel all-reduce" and its
    sequence-parallel reduce-scatter overlap)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, store, fuse):
        x = _gather_first(x, group) if sequence_parallel else x
        x, w, b = autocast_operands(x, weight, bias)
        ctx.save_for_backward(x, w)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.weight, ctx.store, ctx.fuse = weight, store, fuse
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x, work = grad @ w, None
        if ctx.sequence_parallel:
            n = group_size(ctx.group)
            out = torch.empty((grad_x.shape[0] // n, *grad_x.shape[1:]), dtype=grad_x.dtype, device=grad_x.device)
            work = reduce_scatter_single(out, grad_x, group=ctx.group, async_op=True)
        else:
            out = grad_x
            work = dist.all_reduce(out, group=ctx.group, async_op=True)
        grad_w = weight_grad(ctx, grad, x) if ctx.needs_input_grad[1] else None  # overlaps the collective
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        work.wait()
        return out, grad_w, grad_b, None, None, None, None


def column_parallel_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, group: Group,
                           sequence_parallel: bool, store=None, fuse: bool = True) -> Tensor:
    """The column-parallel product with its input collective in one autograd function (for
    tp > 1): the input gradient's all-reduce or reduce-scatter overlaps the weight-gradient GEMM."""
    if group_size(group) == 1:
        raise ValueError("column_parallel_matmul is for tp > 1")
    return apply_linear(_ColumnParallelMatmul, store, x, weight, bias, group, sequence_parallel, store, fuse)
