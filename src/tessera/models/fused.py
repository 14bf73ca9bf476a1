"""Llama's elementwise work as compiled functions, for layers that run eagerly.

RMSNorm, RoPE and SwiGLU are each a handful of small kernels in eager PyTorch, every one reading
and writing the whole activation. Where a whole layer cannot be compiled -- zero-bubble pipeline
schedules defer its weight gradients, CUDA-graphed layers at tp > 1 run eagerly, fused weight
gradients mutate main_grad -- these functions can still be: each is ``torch.compile``d on its own
(one generated kernel forward and one backward, via AOTAutograd), with no linear layer inside, so
no graph break (the gain: BENCHMARKS.md, Pipeline parallelism and Tensor parallelism). Megatron gets the same from ``jit_fuser``
(torch.compile of small functions) and Transformer Engine's fused kernels.

``kernels(fused, x)`` picks the compiled set for CUDA tensors when asked, and the reference ops
(the same functions, uncompiled) otherwise: on a CPU, and inside a layer that is itself being
compiled (inductor fuses them there anyway).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``nn.RMSNorm``'s maths over the last dimension."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding of queries and keys (rotate-half convention, as Llama / HF)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def swiglu(y: Tensor) -> Tensor:
    """``silu(gate) * up`` of the fused gate/up projection's output [..., 2 f] (gate first)."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class Kernels:
    """The three functions, compiled (``compiled=True``) or as they are."""

    def __init__(self, *, compiled: bool):
        # dynamic=None: a second shape recompiles once with symbolic sizes (a new micro-batch or
        # sequence length never exhausts the recompile limit); no fullgraph, so a failure to
        # compile degrades to eager instead of raising (the CPU test compiles them fullgraph)
        wrap = (lambda f: torch.compile(f, dynamic=None)) if compiled else (lambda f: f)
        self.rms_norm, self.rope, self.swiglu = wrap(rms_norm), wrap(rope), wrap(swiglu)


REFERENCE = Kernels(compiled=False)


@functools.cache
def _compiled() -> Kernels:  # built on first use (torch.compile's wrappers import dynamo)
    return Kernels(compiled=True)


def kernels(fused: bool, x: Tensor) -> Kernels:
    """The compiled functions for ``x`` when ``fused``, on CUDA, outside a compiling layer;
    else the reference ones (decided before the cached call, which dynamo would warn about
    inside a compiled layer)."""
    if not fused or not x.is_cuda or torch.compiler.is_compiling():
        return REFERENCE
    return _compiled()
