"""Deferred weight gradients, for zero-bubble pipeline schedules, and gradient-accumulation fusion.

A zero-bubble schedule splits a backward pass in two: ``I`` computes the gradient with respect
to the stage's input (what the previous stage is waiting for) and ``W`` the gradients of the
weights (which nobody waits for, so they can fill idle time). A linear layer given a
:class:`WeightGradStore` runs through :class:`_DeferrableLinear`: inside ``store.defer(key)`` its
backward returns the input gradient at once and files the weight-gradient GEMM under ``key``;
``store.run(key)`` performs them later. Outside a ``defer`` block it is an ordinary linear layer.

Where the gradients go is the store's ``sink``, given at construction: data parallelism's
buffers (``DataParallel.accumulate``), or each parameter's ``.grad``. With ``fuse`` (gradient-
accumulation fusion) a weight gradient is never materialised: the GEMM ``grad_out^T @ input``
adds straight into the parameter's fp32 ``main_grad`` (``sink.accumulate_product``, through
:func:`wgrad_into`: on CUDA one cuBLAS call with bf16 inputs and an fp32 accumulator, as
Megatron's ``fused_weight_gradient_mlp_cuda``, here ``torch.addmm(..., out_dtype=torch.float32)``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class GradSink(Protocol):
    """Where a store's weight gradients go (``tessera.distributed.DataParallel`` is one)."""

    def accumulate(self, param: Tensor, grad: Tensor) -> None: ...

    def accumulate_product(self, param: Tensor, grad_out: Tensor, x: Tensor) -> None: ...

    def accumulate_rows(self, param: Tensor, rows: Tensor, sums: Tensor) -> None: ...


class WeightGradStore:
    """Deferred (and fused) weight gradients of the linear layers that hold this store.

    ``sink``: where gradients go (None: each parameter's ``.grad``). ``fuse``: add each weight
    gradient into its main gradient inside the GEMM (``sink.accumulate_product``)."""

    def __init__(self, sink: GradSink | None = None, fuse: bool = False):
        if fuse and sink is None:
            raise ValueError("fused weight gradients add into main gradients: give the sink that holds them")
        self.sink, self.fuse = sink, fuse
        self.key: object | None = None
        self.pending: dict[object, list] = {}

    def accumulate(self, param: Tensor, grad: Tensor) -> None:
        """Add one micro-batch's gradient of ``param`` where the sink keeps it."""
        if self.sink is not None:
            self.sink.accumulate(param, grad)
        elif param.grad is None:
            param.grad = grad.to(param.dtype)
        else:
            param.grad.add_(grad)

    @contextlib.contextmanager
    def defer(self, key: object):
        outer, self.key = self.key, key
        try:
            yield
        finally:
            self.key = outer  # (an inner block gives its outer one back its key)

    @torch.no_grad()  # outside autograd's backward: the saved input still requires grad
    def run(self, key: object) -> None:
        for compute in self.pending.pop(key, []):
            compute()

    def __len__(self) -> int:
        return sum(map(len, self.pending.values()))

    def clear(self) -> None:
        """Drop every deferred weight gradient (a step that failed between an I and its W left
        them, with the activations they hold: run in the next step, they would be counted twice)."""
        self.pending.clear()
        self.key = None

    def register(self, params) -> None:
        """Let compiled layers reach these parameters' deferred or fused weight gradients without
        a graph break (``tessera::linear_input_grad``). Call once their storage is final (after
        data parallelism placed them in its buffers)."""
        _register(self, params)

    def add_weight_grad(self, weight: Tensor, grad_out: Tensor, x: Tensor) -> None:
        """Add ``grad_out.T @ x`` (2-D) to ``weight``'s gradient, fused inside the GEMM with ``fuse``."""
        if self.fuse:
            self.sink.accumulate_product(weight, grad_out, x)
        else:
            self.accumulate(weight, grad_out.t() @ x)


@functools.lru_cache(maxsize=None)
def _dtype_out_gemm(device: torch.device, out_dtype: torch.dtype, in_dtype: torch.dtype, accumulate: bool) -> bool:
    """Whether this torch has the ``in_dtype`` GEMM writing an ``out_dtype`` result: ``mm`` with
    ``out_dtype`` (``accumulate=False``) or ``addmm`` adding into an ``out_dtype`` matrix
    (``accumulate=True``). CUDA only, fp32 out for bf16/fp16 inputs. Probed once per (device,
    dtypes, kind), never inside a CUDA graph capture (it reads the result on the host): a
    capture's warm-up probes first."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the fused weight-gradient GEMM was first probed inside a CUDA graph capture: "
                           "capture after at least one warm-up iteration")
    try:
        acc = torch.ones(2, 2, dtype=out_dtype, device=device)
        m = torch.ones(2, 2, dtype=in_dtype, device=device)
        if accumulate:
            torch.addmm(acc, m, m, out_dtype=out_dtype, out=acc)
            return bool((acc == 3).all())
        torch.mm(m, m, out_dtype=out_dtype, out=acc)
        return bool((acc == 2).all())
    except (RuntimeError, TypeError):
        return False


def fused_supported(out: Tensor, a: Tensor, accumulate: bool) -> bool:
    """Whether :func:`wgrad_into` can run fused here (for the first product, or an added one):
    always when ``out`` has the inputs' dtype (plain mm/addmm into it, any device, which is how
    the fp32 CPU tests run the fused branch); for 16-bit inputs into fp32, where this CUDA torch
    has the GEMM."""
    if out.dtype == a.dtype:
        return True
    if out.device.type != "cuda":
        return False
    return _dtype_out_gemm(out.device, out.dtype, a.dtype, accumulate)


def wgrad_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool, fused: bool | None = None) -> None:
    """``out (+)= a @ b`` where ``out`` may be fp32 and ``a``, ``b`` 16-bit.

    Fused (CUDA): one GEMM that writes (or, accumulating, reads and writes) ``out`` in its own
    dtype, so the 16-bit product is never rounded nor stored. Reference (16-bit inputs off CUDA,
    or a torch without that GEMM): the product in the inputs' dtype, then added (or copied) into
    ``out``.
    ``fused=None`` chooses by device and torch; tests force either."""
    if fused is None:
        fused = fused_supported(out, a, accumulate)
    if not fused:
        product = a @ b
        out.add_(product) if accumulate else out.copy_(product)
    elif out.dtype == a.dtype:
        torch.addmm(out, a, b, out=out) if accumulate else torch.mm(a, b, out=out)
    else:
        (torch.addmm(out, a, b, out_dtype=out.dtype, out=out) if accumulate
         else torch.mm(a, b, out_dtype=out.dtype, out=out))


def autocast_operands(x: Tensor, weight: Tensor, bias: Tensor | None):
    """The operands as autocast would cast them (so the casts are what backward saves)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None
    return x, weight, bias


def weight_grad(ctx, grad: Tensor, x: Tensor) -> Tensor | None:
    """The weight gradient of ``y = x W^T`` for a layer with a store (``ctx.weight``,
    ``ctx.store``, ``ctx.fuse``): returned for autograd, or filed for later (a zero-bubble I step),
    or added straight into the main gradient (fusion) -- then None."""
    weight, store = ctx.weight, ctx.store
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if store is not None and store.key is not None:  # zero-bubble I step: the W GEMM runs later
        store.pending.setdefault(store.key, []).append(lambda: store.add_weight_grad(weight, g2, x2))
        return None
    if store is not None and ctx.fuse and store.fuse:  # into main_grad
        store.sink.accumulate_product(weight, g2, x2)
        return None
    return (g2.t() @ x2).to(weight.dtype)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore, fuse: bool):
        autocasting = torch.is_autocast_enabled(x.device.type)
        x, w, b = autocast_operands(x, weight, bias)
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.has_bias, ctx.store, ctx.fuse = weight, bias is not None, store, fuse
        if not autocasting:  # (16-bit models hold 16-bit weights: no autocast, no context to enter)
            return F.linear(x, w, b)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        grad_x = grad @ w if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        grad_w = weight_grad(ctx, grad, x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, grad_b, None, None


def apply_linear(function: type[torch.autograd.Function], store: WeightGradStore | None, *args):
    """``function.apply(*args)`` for a linear layer's autograd function; with a ``store`` (one of
    ``args`` too), run eagerly even inside a compiled layer (:func:`_apply_eager`). Outside
    compiled code it is called directly: the ``torch.compiler.disable`` wrapper costs host time on
    every call (BENCHMARKS.md, Data pipeline and CPU)."""
    if store is None or not torch.compiler.is_compiling():
        return function.apply(*args)
    return _apply_eager(function, *args)


@torch.compiler.disable
def _apply_eager(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, run eagerly even inside a compiled layer.

    The autograd functions that take a :class:`WeightGradStore` file their weight-gradient GEMM
    for later (zero-bubble) or add it in place into ``main_grad`` (fusion): Python state and a
    mutation of a tensor that is not an input, which the compiler cannot put into a graph. So a
    compiled layer breaks its graph around each such linear layer and compiles the work between
    them (norms, attention, activations, residual adds, the TP collectives), where inductor's
    fusions are; the GEMMs would have been cuBLAS calls either way."""
    return function.apply(*args)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore | None,
           fuse: bool = True) -> Tensor:
    """``F.linear``, with a deferrable (and fusable) weight gradient when a store is given.
    ``fuse=False`` for a weight that also gets gradients elsewhere in the same backward (a tied
    embedding used as the output layer): autograd must sum those before the gradient hook.
    Inside a compiled layer, a weight the store has registered runs as tessera's own opaque ops
    (no graph break, ``tessera::deferrable_linear``), unless ``fuse=False`` (the ops hand
    autograd no weight gradient to sum); others break the graph (:func:`_apply_eager`)."""
    if store is None:
        return F.linear(x, weight, bias)
    if not torch.compiler.is_compiling():
        return _DeferrableLinear.apply(x, weight, bias, store, fuse)
    if fuse and _opaque_linear_applies(x, weight):
        return _linear_op(x, weight, bias)
    return _apply_eager(_DeferrableLinear, x, weight, bias, store, fuse)


# -- inside compiled layers: the deferrable linear as two opaque ops ------------------------------
# A compiled layer cannot hold the Python state a deferred weight gradient needs (the store, the
# parameter, the pending list), and breaking the graph around each such linear layer (~6 graphs per
# layer) costs more host time than inductor saves (BENCHMARKS.md, One GPU). So the product is
# ``tessera::deferrable_linear`` and its backward ``tessera::linear_input_grad``, which returns the
# input gradient (so the op stays in the graph) and, as a side effect when it runs, files the
# weight-gradient GEMM in the store, fuses it into ``main_grad``, or adds it (what
# :func:`weight_grad` does eagerly). The op finds the parameter and its store by the parameter's
# data pointer (stable once data parallelism placed it in its buffer): registered by
# :meth:`WeightGradStore.register`, in ``_REGISTERED`` (weak references; a registry, as torch's own
# op registry, since compiled code passes only tensors and numbers). The side effect runs where the
# compiled backward runs: inductor's default mode, not "reduce-overhead" (its CUDA graphs would
# replay the GEMMs, not the Python), which tessera never asks for.
_REGISTERED: dict[int, tuple] = {}


def _register(store: WeightGradStore, params) -> None:
    for p in params:
        if p.requires_grad:
            _REGISTERED[p.data_ptr()] = (weakref.ref(p), weakref.ref(store))
            p._wgrad_registered = True  # what tracing reads (a data pointer it cannot)


def _registered(weight: Tensor) -> tuple:
    entry = _REGISTERED.get(weight.data_ptr())
    param, store = (entry[0](), entry[1]()) if entry else (None, None)
    if param is None or store is None or param.data_ptr() != weight.data_ptr() or param.shape != weight.shape \
            or param.dtype != weight.dtype:  # (a stale entry: its parameter moved or another took the address)
        raise RuntimeError(f"a compiled layer's {tuple(weight.shape)} weight is not registered with its "
                           "WeightGradStore (store.register(params) after data parallelism placed them)")
    return param, store


def _opaque_linear_applies(x: Tensor, weight: Tensor) -> bool:
    """At trace time: the opaque ops fit (a registered weight, no autocast, an input whose
    gradient backward computes, so the filing op is never dropped as unused)."""
    return (getattr(weight, "_wgrad_registered", False) and weight.requires_grad and x.requires_grad
            and not torch.is_autocast_enabled(x.device.type))


@torch.library.custom_op("tessera::deferrable_linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("tessera::linear_input_grad", mutates_args=())
def _input_grad_op(grad: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """``grad @ weight``; and the weight's gradient filed, fused or added (a side effect)."""
    param, store = _registered(weight)
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if store.key is not None:  # zero-bubble I step: the W GEMM runs later, on copies: compiled
        # code may reuse its intermediate buffers (``grad``) once this op has returned
        g2, x2 = g2.clone(), x2.clone()
        store.pending.setdefault(store.key, []).append(lambda: store.add_weight_grad(param, g2, x2))
    elif store.fuse:  # (only fusable weights take these ops)
        store.sink.accumulate_product(param, g2, x2)
    else:
        store.accumulate(param, (g2.t() @ x2).to(param.dtype))
    return grad @ weight


@_input_grad_op.register_fake
def _(grad, x, weight):
    return grad.new_empty(*grad.shape[:-1], weight.shape[1])


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return _input_grad_op(grad, x, weight), None, grad_b


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)
