"""FP8 linear layers (``train.fp8``): the three GEMMs of a linear layer in float8, with dynamic
scales that do not depend on the parallel layout.

A tensor is quantized as ``q = clamp(t * s, ±max).to(float8)`` with ``s = max / amax``, and a
GEMM of two quantized operands multiplies their dequantizing factors ``1/s`` back in
(``torch._scaled_mm``, fp32 accumulation). Forward operands are e4m3 (more mantissa), the
gradient e5m2 (more range). ``tensorwise``: one scale per tensor; ``rowwise``: one per row of
each GEMM operand along its contraction dimension (so each tensor is quantized along the axis its
GEMM reduces, as torchao's rowwise recipe does).

A scale is taken over the whole logical tensor, never a TP shard: where the amax reduces over a
dimension the TP group splits (the output features of a column-parallel layer, the input
features of a row-parallel one), the shard's amax is all-reduced with MAX over the group first.
So tp=2 + SP quantizes every operand exactly as tp=1 does, and the layout never changes the
maths. Off CUDA the GEMM is emulated: the operands dequantized to fp32 and multiplied, the same
products with fp32 accumulation in another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TINY = 1e-12  # the amax of an all-zero tensor: every element quantizes to 0


@dataclass(frozen=True)
class Float8Recipe:
    """How the linear layers of the transformer layers compute in fp8."""

    scaling: str  # "tensorwise" or "rowwise"

    def __post_init__(self) -> None:
        if self.scaling not in ("tensorwise", "rowwise"):
            raise ValueError(f"fp8 scaling is tensorwise or rowwise, not {self.scaling!r}")


def quantize(t: Tensor, dtype: torch.dtype, reduce_dims: tuple[int, ...], sharded: bool, group) -> tuple[Tensor, Tensor]:
    """(``t`` in ``dtype``, the factor that dequantizes it), the scale one per index of the dims not
    in ``reduce_dims`` (all of them: one per tensor). ``sharded``: a reduced dim is split over
    ``group``, whose amax is the maximum of the shards'."""
    amax = t.detach().abs().float().amax(dim=reduce_dims, keepdim=True) if reduce_dims else t.detach().abs().float()
    if sharded and group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = torch.finfo(dtype).max / amax.clamp(min=TINY)
    q = (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return q, scale.reciprocal()


def scaled_matmul(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a * a_inv) @ (b * b_inv)``: a [m, k] and b [k, n] in float8, a_inv scalar or [m, 1],
    b_inv scalar or [1, n]. ``torch._scaled_mm`` on CUDA (sizes divisible by 16), else emulated in fp32."""
    m, k = a.shape
    n = b.shape[1]
    if a.is_cuda and m % 16 == 0 and k % 16 == 0 and n % 16 == 0:
        sa = a_inv.float().reshape(()) if a_inv.numel() == 1 else a_inv.float().reshape(-1, 1)
        sb = b_inv.float().reshape(()) if b_inv.numel() == 1 else b_inv.float().reshape(1, -1)
        # (_scaled_mm takes a row-major first operand and a column-major second)
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


class _Float8Linear(torch.autograd.Function):
    """``y = x W^T + b`` with x [m, k] and W [n, k] in fp8. ``sharded``: which of W's dims the TP
    group splits ("n": column-parallel, "k": row-parallel, None), so which amaxes to reduce.
    ``store``: a WeightGradStore (deferred or accumulated weight gradients, as the bf16 path)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, group, sharded, store):
        x2 = x.reshape(-1, x.shape[-1])
        rowwise = recipe.scaling == "rowwise"
        # y = x @ W^T: x's rows and W's rows, each over k
        xq, xs = quantize(x2, E4M3, (1,) if rowwise else (0, 1), sharded == "k", group)
        wq, ws = quantize(weight, E4M3, (1,) if rowwise else (0, 1), sharded == "k" if rowwise else sharded is not None,
                          group)
        y = scaled_matmul(xq, xs, wq.t(), ws.t(), x.dtype)
        if bias is not None:
            y = y + bias
        if rowwise:  # the backward's GEMMs reduce over other axes: quantized again from these
            ctx.save_for_backward(x2, weight)
        else:
            ctx.save_for_backward(xq, xs, wq, ws)
        ctx.recipe, ctx.group, ctx.sharded, ctx.store, ctx.weight = recipe, group, sharded, store, weight
        ctx.has_bias, ctx.x_shape, ctx.dtype = bias is not None, x.shape, x.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        g2 = grad.reshape(-1, grad.shape[-1])  # [m, n]
        group, sharded, rowwise = ctx.group, ctx.sharded, ctx.recipe.scaling == "rowwise"
        if rowwise:
            x2, weight = ctx.saved_tensors
            # dx = g @ W: g's rows over n, W's columns over n
            gq, gs = quantize(g2, E5M2, (1,), sharded == "n", group)
            wq, ws = quantize(weight, E4M3, (0,), sharded == "n", group)
            grad_x = scaled_matmul(gq, gs, wq, ws, ctx.dtype)
            # dW = g^T @ x: g's columns over m, x's columns over m (m is never split)
            gtq, gts = quantize(g2.t(), E5M2, (1,), False, group)
            xq, xs = quantize(x2, E4M3, (0,), False, group)
        else:
            xq, xs, wq, ws = ctx.saved_tensors
            gq, gs = quantize(g2, E5M2, (0, 1), sharded == "n", group)
            grad_x = scaled_matmul(gq, gs, wq, ws, ctx.dtype)
            gtq, gts = gq.t(), gs
        grad_b = g2.sum(0) if ctx.has_bias else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            weight, store = ctx.weight, ctx.store

            def weight_gradient() -> Tensor:
                return scaled_matmul(gtq, gts, xq, xs, torch.float32)

            if store is not None and store.key is not None:  # a zero-bubble I step: W later
                store.pending.setdefault(store.key, []).append(lambda: store.accumulate(weight, weight_gradient()))
            elif store is not None and store.sink is not None:  # into the main gradient
                store.accumulate(weight, weight_gradient())
            else:
                grad_w = weight_gradient().to(weight.dtype)
        return grad_x.view(ctx.x_shape), grad_w, grad_b, None, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Float8Recipe, group=None,
               sharded: str | None = None, store=None) -> Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in float8 (see the module docstring)."""
    return _Float8Linear.apply(x, weight, bias, recipe, group, sharded, store)
