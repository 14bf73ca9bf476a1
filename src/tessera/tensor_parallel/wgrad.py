"""Deferred weight gradients, for zero-bubble pipeline schedules.

A zero-bubble schedule splits a backward pass in two: ``I`` computes the gradient with respect
to the stage's input (what the previous stage is waiting for) and ``W`` the gradients of the
weights (which nobody waits for, so they can fill idle time). A linear layer given a
:class:`WeightGradStore` runs through :class:`_DeferrableLinear`: inside ``store.defer(key)`` its
backward returns the input gradient at once and files the weight-gradient GEMM under ``key``;
``store.run(key)`` performs them later, accumulating into ``weight.grad`` (or wherever
``store.accumulate`` says). Outside a ``defer``
block it is an ordinary linear layer.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor


class WeightGradStore:
    def __init__(self):
        self.key: object | None = None
        self.pending: dict[object, list] = {}
        # Where a deferred weight gradient goes: into ``weight.grad`` by default; data parallelism
        # (tessera.distributed.DataParallel) points this at its gradient buffers.
        self.accumulate = _accumulate

    @contextlib.contextmanager
    def defer(self, key: object):
        self.key = key
        try:
            yield
        finally:
            self.key = None

    @torch.no_grad()  # outside autograd's backward: the saved input still requires grad
    def run(self, key: object) -> None:
        for compute in self.pending.pop(key, []):
            compute()

    def __len__(self) -> int:
        return sum(map(len, self.pending.values()))


def _accumulate(param: Tensor, grad: Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # cast as autocast would, and save the casts
            dtype = torch.get_autocast_dtype(device)
            x, w = x.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
        else:
            w, b = weight, bias
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.has_bias, ctx.store = weight, bias is not None, store
        with torch.autocast(device, enabled=False):
            return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        grad_x = grad @ w
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        weight, store = ctx.weight, ctx.store

        def weight_grad() -> Tensor:
            return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

        if store.key is None:
            return grad_x, weight_grad().to(weight.dtype), grad_b, None
        store.pending.setdefault(store.key, []).append(lambda: store.accumulate(weight, weight_grad()))
        return grad_x, None, grad_b, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore | None) -> Tensor:
    """``F.linear``, with a deferrable weight gradient when a store is given."""
    if store is None:
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store)
