"""FP8 maths of the linear layers (``train.fp8``): the three GEMMs of a linear layer in float8,
with dynamic scales that do not depend on the parallel layout (the layers' autograd function:
tensor_parallel/fp8_linear.py).

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

Everything here is plain torch ops with no host sync (no ``.item()``, no tensor read on the host),
so torch.compile traces it whole; :class:`Float8WeightCache` keeps a tensorwise weight's fp8 copy
for a step's micro-batches in eager code.
"""

from __future__ import annotations

import weakref
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


def amax_over_group(amax: Tensor, group) -> Tensor:
    """The maximum of every rank's ``amax`` (in a new tensor, on the device: no host wait). Inside
    compiled code one opaque op, so the compiler neither reorders around nor rewrites the
    collective (as tensor_parallel/mappings.py does for the TP collectives)."""
    if group is None or dist.get_world_size(group) == 1:
        return amax
    if torch.compiler.is_compiling():
        return _all_reduce_max_op(amax, group.group_name)
    return _all_reduce_max(amax, group)


def _all_reduce_max(amax: Tensor, group) -> Tensor:
    out = amax.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


@torch.library.custom_op("tessera::all_reduce_max", mutates_args=())
def _all_reduce_max_op(amax: Tensor, group_name: str) -> Tensor:
    from torch.distributed.distributed_c10d import (
        _resolve_process_group,  # private: late
    )

    return _all_reduce_max(amax, _resolve_process_group(group_name))


@_all_reduce_max_op.register_fake
def _(amax: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(amax, memory_format=torch.contiguous_format)


def quantize(t: Tensor, dtype: torch.dtype, reduce_dims: tuple[int, ...], sharded: bool, group) -> tuple[Tensor, Tensor]:
    """(``t`` in ``dtype``, the factor that dequantizes it), the scale one per index of the dims not
    in ``reduce_dims`` (all of them: one per tensor). ``sharded``: a reduced dim is split over
    ``group``, whose amax is the maximum of the shards'. Plain torch ops and no host sync, so a
    compiled layer fuses the amax into one reduction and the scale, clamp and cast into one
    elementwise kernel."""
    amax = t.detach().abs().float().amax(dim=reduce_dims, keepdim=True) if reduce_dims else t.detach().abs().float()
    if sharded:
        amax = amax_over_group(amax, group)
    return quantize_with_amax(t, dtype, amax)


def quantize_with_amax(t: Tensor, dtype: torch.dtype, amax: Tensor) -> tuple[Tensor, Tensor]:
    """(``t`` in ``dtype`` under the scale ``max / amax``, its dequantizing factor): :func:`quantize`
    once the amax is known; FSDP's fp8 gather casts each shard under the whole weight's amax
    (distributed/fsdp_fp8.py)."""
    scale = torch.finfo(dtype).max / amax.clamp(min=TINY)
    q = (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return q, scale.reciprocal()


def kernel_applies(a: Tensor, b: Tensor) -> bool:
    """Whether :func:`scaled_matmul` runs ``a @ b`` as ``torch._scaled_mm`` (CUDA, sizes divisible by 16)."""
    return a.is_cuda and a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


def kernel_layout(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` row-major and ``b`` column-major where the kernel runs, as ``_scaled_mm`` takes them;
    done before an opaque op, these transposing copies are in the graph, where inductor writes
    them from its cast kernels instead of copying again."""
    if not kernel_applies(a, b):
        return a, b
    return a.contiguous(), b.t().contiguous().t()


def scaled_matmul(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype,
                  kernel: bool | None = None) -> Tensor:
    """``(a * a_inv) @ (b * b_inv)``: a [m, k] and b [k, n] in float8, a_inv scalar or [m, 1],
    b_inv scalar or [1, n]. ``torch._scaled_mm`` on CUDA (sizes divisible by 16), else emulated in
    fp32. ``kernel``: force either (a test runs ``_scaled_mm``'s CPU kernel as CUDA's call)."""
    if kernel is None:
        kernel = kernel_applies(a, b)
    if kernel:
        sa = a_inv.float().reshape(()) if a_inv.numel() == 1 else a_inv.float().reshape(-1, 1)
        sb = b_inv.float().reshape(()) if b_inv.numel() == 1 else b_inv.float().reshape(1, -1)
        # (_scaled_mm takes a row-major first operand and a column-major second)
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


class Float8WeightCache:
    """The tensorwise fp8 copies of weights, cast once per step instead of once per micro-batch.

    An entry is the weight's (fp8 copy, dequantizing factor), valid while the weight keeps its
    storage and version counter and the cache its generation. :meth:`invalidate` (a new
    generation: the optimizer's step hook calls it, ``training/build.py``) drops every entry, so
    the next forward casts the updated weights; the version counter also catches in-place writes
    between steps (a checkpoint load). Every TP rank of a layer misses together (the same steps,
    the same writes), so the amax all-reduce of a cast stays collective. Not used inside compiled
    code (the cast is fused there) nor under a CUDA graph capture (a replay would not re-run the
    lookup)."""

    def __init__(self) -> None:
        self.generation = 0
        self._entries: dict[int, tuple] = {}

    def invalidate(self, *_) -> None:
        """Drop every copy (any arguments are ignored: an optimizer hook passes some)."""
        self.generation += 1
        self._entries.clear()

    def get(self, weight: Tensor, cast) -> tuple[Tensor, Tensor]:
        """``cast()``'s (fp8 weight, factor), cast on the first use of ``weight`` since a change."""
        key = (self.generation, weight.data_ptr(), weight._version, weight.shape)
        entry = self._entries.get(id(weight))
        if entry is not None and entry[0] == key and entry[1]() is weight:
            return entry[2]
        value = cast()
        self._entries[id(weight)] = (key, weakref.ref(weight), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)


def cache_applies(cache: Float8WeightCache | None, weight: Tensor) -> bool:
    """Whether ``cache`` serves this cast: eager code, outside a CUDA graph capture."""
    if cache is None or torch.compiler.is_compiling():
        return False
    return not (weight.is_cuda and torch.cuda.is_current_stream_capturing())
