"""The fp8 linear layer of the tensor-parallel layers (``train.fp8``; the maths: precision/fp8.py).

``y = x W^T + b`` with its three GEMMs in float8: forward ``x @ W^T`` (e4m3 operands), backward
``dx = g @ W`` and ``dW = g^T @ x`` (the gradient g in e5m2). One autograd function that
torch.compile traces whole (no graph break): the casts are plain torch ops that inductor fuses
into its neighbouring kernels, each GEMM one ``torch._scaled_mm`` on CUDA. What does not fit a
graph stays out of it:

* a deferred or fused weight gradient (a ``WeightGradStore``): inside compiled code the backward's
  two GEMMs are one opaque op, ``tessera::fp8_input_grad``, that returns dx and files, fuses or
  adds dW as a side effect, finding the store by the weight's storage (as the bf16
  ``tessera::linear_input_grad`` of wgrad.py); in eager code the function does it directly;
* the weight cache (``Float8WeightCache``, tensorwise): eager code only; compiled code casts the
  weight in its fused kernels.

A weight FSDP gathered in fp8 (zero=3, tensorwise: distributed/fsdp_fp8.py) arrives as a
``Float8Weight``: its e4m3 bytes and factor are the cast weight, as the cache's are.

Under sequence parallelism a tensorwise column-parallel layer gathers its input in fp8: each rank
quantizes its sequence slice under the scale of the whole gathered tensor (the amax all-reduced
with MAX over TP), and the ranks all-gather the fp8 bytes, half of bf16's. Quantizing commutes
with gathering under a shared scale, so this is exactly the bf16 gather followed by the cast.
Backward reduce-scatters the input gradient, as ``gather_from_sequence_region`` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tessera.distributed.fsdp_fp8 import Float8Weight
from tessera.precision.fp8 import (
    E4M3,
    E5M2,
    Float8Recipe,
    Float8WeightCache,
    cache_applies,
    kernel_layout,
    quantize,
    scaled_matmul,
)
from tessera.tensor_parallel.mappings import (
    Group,
    _gather_first,
    _reduce_scatter_first,
    group_size,
)
from tessera.tensor_parallel.wgrad import WeightGradStore, _apply_eager, _registered


def gather_quantized(x: Tensor, group: Group) -> tuple[Tensor, Tensor]:
    """(the sequence-parallel ``x`` [s/tp, ...] gathered along dim 0 in e4m3, its one factor):
    the scale is the whole gathered tensor's, so the bytes equal quantizing the bf16 gather."""
    xq, xs = quantize(x, E4M3, tuple(range(x.dim())), True, group)
    if group_size(group) == 1:
        return xq, xs
    return _gather_first(xq.view(torch.uint8), group).view(E4M3), xs  # (c10d moves bytes, not fp8)


def _file_weight_grad(store, weight: Tensor, gtq: Tensor, gts: Tensor, xq: Tensor, xs: Tensor, clone: bool) -> None:
    """``dW = (g^T @ x)`` in fp32: filed for a zero-bubble W step, or added where the store keeps it."""
    if store.key is not None:  # zero-bubble I step: the W GEMM runs later (on copies in compiled
        if clone:  # code, which may reuse its buffers once the op has returned)
            gtq, gts, xq, xs = gtq.clone(), gts.clone(), xq.clone(), xs.clone()
        store.pending.setdefault(store.key, []).append(
            lambda: store.accumulate(weight, scaled_matmul(gtq, gts, xq, xs, torch.float32)))
    else:  # into the main gradient (fused stores included: _scaled_mm has no accumulating form)
        store.accumulate(weight, scaled_matmul(gtq, gts, xq, xs, torch.float32))


@torch.library.custom_op("tessera::fp8_input_grad", mutates_args=())
def _input_grad_op(gq: Tensor, gs: Tensor, wq: Tensor, ws: Tensor, gtq: Tensor, gts: Tensor, xq: Tensor,
                   xs: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``dx = g @ W`` in fp8; and ``dW`` filed, fused or added for the weight's store (a side effect)."""
    param, store = _registered(weight)
    _file_weight_grad(store, param, gtq, gts, xq, xs, clone=True)
    return scaled_matmul(gq, gs, wq, ws, out_dtype)


@_input_grad_op.register_fake
def _(gq, gs, wq, ws, gtq, gts, xq, xs, weight, out_dtype):
    return gq.new_empty(gq.shape[0], wq.shape[1], dtype=out_dtype)


class _Float8Linear(torch.autograd.Function):
    """``y = x W^T + b`` with x [m, k] and W [n, k] in fp8. ``sharded``: which of W's dims the TP
    group splits ("n": column-parallel, "k": row-parallel, None), so which amaxes to reduce.
    ``gather``: x is a sequence slice, gathered in fp8 (tensorwise, column-parallel).
    ``store``: a WeightGradStore (eager code); ``registered``: compiled code whose weight a
    store registered (the opaque op files dW). ``wcache``: the weight's fp8 copy and factor."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, group, sharded, store, registered, gather, wcache):
        rowwise = recipe.scaling == "rowwise"
        if gather:  # [s/tp, b, k] -> x2 [s*b, k], quantized under the whole tensor's scale
            xq, xs = gather_quantized(x, group)
            out_shape = (*xq.shape[:-1], weight.shape[0])
            xq = xq.reshape(-1, x.shape[-1])
        else:
            x2 = x.reshape(-1, x.shape[-1])
            # y = x @ W^T: x's rows and W's rows, each over k
            xq, xs = quantize(x2, E4M3, (1,) if rowwise else (0, 1), sharded == "k", group)
            out_shape = (*x.shape[:-1], weight.shape[0])
        if wcache is not None:
            wq, ws = wcache
        else:
            wq, ws = quantize(weight, E4M3, (1,) if rowwise else (0, 1),
                              sharded == "k" if rowwise else sharded is not None, group)
        y = scaled_matmul(xq, xs, wq.t(), ws.t(), x.dtype)
        if bias is not None:
            y = y + bias
        if rowwise:  # the backward's GEMMs reduce over other axes: quantized again from these
            ctx.save_for_backward(x2, weight)
        else:
            ctx.save_for_backward(xq, xs, wq, ws, weight)
        ctx.recipe, ctx.group, ctx.sharded, ctx.registered, ctx.gather = recipe, group, sharded, registered, gather
        if store is not None:
            ctx.store, ctx.weight = store, weight
        else:
            ctx.store = None
        ctx.has_bias, ctx.x_shape, ctx.dtype = bias is not None, x.shape, x.dtype
        return y.view(out_shape)

    @staticmethod
    def backward(ctx, grad):
        g2 = grad.reshape(-1, grad.shape[-1])  # [m, n]
        group, sharded, rowwise = ctx.group, ctx.sharded, ctx.recipe.scaling == "rowwise"
        if rowwise:
            x2, weight = ctx.saved_tensors
            # dx = g @ W: g's rows over n, W's columns over n
            gq, gs = quantize(g2, E5M2, (1,), sharded == "n", group)
            wq, ws = quantize(weight, E4M3, (0,), sharded == "n", group)
            # dW = g^T @ x: g's columns over m, x's columns over m (m is never split)
            gtq, gts = quantize(g2.t(), E5M2, (1,), False, group)
            xq, xs = quantize(x2, E4M3, (0,), False, group)
        else:
            xq, xs, wq, ws, weight = ctx.saved_tensors
            gq, gs = quantize(g2, E5M2, (0, 1), sharded == "n", group)
            gtq, gts = gq.t(), gs
        grad_b = g2.sum(0) if ctx.has_bias else None
        grad_w = None
        wants_w = ctx.needs_input_grad[1]
        if wants_w and ctx.registered:  # compiled: one opaque op for both GEMMs, operands laid out in the graph
            gq, wq = kernel_layout(gq, wq)
            gtq, xq = kernel_layout(gtq, xq)
            grad_x = _input_grad_op(gq, gs, wq, ws, gtq, gts, xq, xs, weight, ctx.dtype)
        else:
            grad_x = scaled_matmul(gq, gs, wq, ws, ctx.dtype)
            if wants_w and ctx.store is not None:
                _file_weight_grad(ctx.store, ctx.weight, gtq, gts, xq, xs, clone=False)
            elif wants_w:
                grad_w = scaled_matmul(gtq, gts, xq, xs, torch.float32).to(weight.dtype)
        if ctx.gather:  # the gathered input's gradient: partial sums over TP, reduce-scattered
            grad_x = _reduce_scatter_first(grad_x.view(-1, *ctx.x_shape[1:]), group)
        return grad_x.view(ctx.x_shape), grad_w, grad_b, None, None, None, None, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Float8Recipe, group: Group = None,
               sharded: str | None = None, store: WeightGradStore | None = None,
               cache: Float8WeightCache | None = None, gather: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in float8 (the module docstring).
    ``cache``: reuse the weight's fp8 copy until it changes (tensorwise). ``gather``: ``x`` is this
    rank's sequence slice [s/tp, b, k] of a column-parallel layer's input, all-gathered in fp8
    (tensorwise; backward reduce-scatters its gradient)."""
    rowwise = recipe.scaling == "rowwise"
    if gather and (rowwise or sharded != "n"):
        raise ValueError("an fp8 gather of the input is for tensorwise column-parallel layers")
    gather = gather and group_size(group) > 1
    wcache = None
    if isinstance(weight, Float8Weight):  # gathered in fp8 under the whole weight's scale
        if rowwise:
            raise ValueError("a weight gathered in fp8 is cast tensorwise; rowwise gathers it in train.dtype")
        wcache = weight.fp8()
    elif cache is not None and not rowwise and cache_applies(cache, weight):
        # (detached: outside the autograd function a cast on the weight would enter autograd's graph)
        wcache = cache.get(weight, lambda: quantize(weight.detach(), E4M3, (0, 1), sharded is not None, group))
    if store is None or not torch.compiler.is_compiling():
        return _Float8Linear.apply(x, weight, bias, recipe, group, sharded, store, False, gather, wcache)
    if getattr(weight, "_wgrad_registered", False) and weight.requires_grad:  # the opaque op files dW
        return _Float8Linear.apply(x, weight, bias, recipe, group, sharded, None, True, gather, None)
    return _apply_eager(_Float8Linear, x, weight, bias, recipe, group, sharded, store, False, gather, wcache)
