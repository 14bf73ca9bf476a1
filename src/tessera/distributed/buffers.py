"""Contiguous parameter and gradient buffers cut into buckets (Megatron's param_and_grad_buffer).

One model chunk's trainable parameters are laid out back to front (the order backward produces
their gradients) in one flat buffer of the model's dtype; every parameter becomes a view of it.
Gradients accumulate, over micro-batches, into ``param.main_grad``: a view of a second flat
buffer of ``grad_dtype`` with the same layout. The layout is cut into buckets of about
``bucket_size`` elements; a bucket is the unit of data-parallel reduction.

    buffer  |  bucket 0 (last layers)  |  bucket 1  | ... |  bucket k (embedding) |
    bucket  | rank 0's shard | rank 1's shard | ... |     (length divisible by dp)

Each parameter starts on a multiple of ``ALIGN`` elements (aligned GEMM operands), and each bucket
is padded to a multiple of ``ALIGN * dp`` so that it splits into dp equal, aligned shards: the
distributed optimizer owns shard ``dp_rank`` of every bucket. A parameter tied across pipeline
stages (``param.tied_across_stages``) gets a bucket of its own, so the first and last stage shard
it identically and its gradient shards can be summed over the embedding group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Bucket:
    """A contiguous range ``[start, end)`` of the buffers and the parameters inside it."""

    def __init__(self, index: int, params: list[nn.Parameter], start: int, end: int):
        self.index, self.params, self.start, self.end = index, params, start, end
        self.grad: Tensor | None = None  # this bucket's slice of the gradient buffer (flat)
        self.param: Tensor | None = None  # this bucket's slice of the parameter buffer (flat)

    @property
    def numel(self) -> int:
        return self.end - self.start


class ParamAndGradBuffer:
    """Flat storage for one chunk's parameters and their accumulated gradients.

    ``keep_grads=False`` (zero=2) allocates no gradient buffer: a bucket's gradients live in a
    bucket-sized buffer from its first gradient of a micro-batch to its reduction
    (:meth:`allocate_grad` / :meth:`release_grad`).
    """

    def __init__(self, params: list[nn.Parameter], *, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 bucket_size: int, dp: int, device: torch.device, keep_grads: bool = True):
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"ParamAndGradBuffer: dp must be an integer >= 1 (the data-parallel size), got {dp!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"ParamAndGradBuffer: bucket_size must be an integer >= 1 (elements), got {bucket_size!r}")
        self.param_dtype, self.grad_dtype, self.dp, self.device = param_dtype, grad_dtype, dp, device
        self.offsets: dict[nn.Parameter, tuple[int, int]] = {}  # param -> [lo, hi) in the buffer
        self.buckets: list[Bucket] = []
        self._layout(params[::-1], bucket_size)
        self.numel = self.buckets[-1].end if self.buckets else 0

        self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        for p, (lo, hi) in self.offsets.items():
            self.param_data[lo:hi].copy_(p.detach().reshape(-1))
            p.data = self.param_data[lo:hi].view(p.shape)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device) if keep_grads else None
        for bucket in self.buckets:
            bucket.param = self.param_data[bucket.start:bucket.end]
            if keep_grads:
                self._point_grads(bucket, self.grad_data[bucket.start:bucket.end])
            else:
                for p in bucket.params:
                    p.main_grad = None

    def _layout(self, params: list[nn.Parameter], bucket_size: int) -> None:
        pad_to = ALIGN * self.dp
        offset, start, members = 0, 0, []

        def close() -> None:
            nonlocal offset, start, members
            if members:
                end = _round_up(offset, pad_to)
                self.buckets.append(Bucket(len(self.buckets), members, start, end))
                offset = start = end
                members = []

        for p in params:
            alone = getattr(p, "tied_across_stages", False)
            if alone:
                close()
            lo = _round_up(offset, ALIGN)
            self.offsets[p] = (lo, lo + p.numel())
            offset = lo + p.numel()
            members.append(p)
            if alone or offset - start >= bucket_size:
                close()
        close()

    def _point_grads(self, bucket: Bucket, flat: Tensor | None) -> None:
        bucket.grad = flat
        for p in bucket.params:
            lo, hi = self.offsets[p]
            p.main_grad = None if flat is None else flat[lo - bucket.start:hi - bucket.start].view(p.shape)

    def allocate_grad(self, bucket: Bucket) -> None:
        """zero=2: a fresh zeroed gradient buffer for ``bucket`` (its params' main_grad point into it)."""
        self._point_grads(bucket, torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.device))

    def release_grad(self, bucket: Bucket) -> None:
        """zero=2: hand the bucket's gradient buffer to its reduction; the next gradient allocates anew."""
        self._point_grads(bucket, None)

    def param_range(self, p: nn.Parameter) -> tuple[int, int]:
        return self.offsets[p]


@dataclass
class OptimizerRange:
    """The part ``[lo, hi)`` of one bucket that this rank's optimizer updates: the whole bucket
    (zero=0) or this rank's shard (zero 1/2)."""

    buffer: ParamAndGradBuffer
    bucket: Bucket
    lo: int
    hi: int
    grad: Tensor  # the reduced fp32 gradient of [lo, hi)
    own_grad: bool  # ``grad`` has storage of its own (else it is a view of the gradient buffer)
    refresh: bool = False  # zero=0 with bf16 gradients: ``grad`` is an fp32 copy of the reduced buffer
    fragments: list[tuple[nn.Parameter, int, int]] = field(default_factory=list)  # (param, a, b) within the range

    @property
    def param(self) -> Tensor:
        return self.buffer.param_data[self.lo:self.hi]

    def fp32_grad(self) -> Tensor:
        if self.refresh:
            self.grad.copy_(self.buffer.grad_data[self.lo:self.hi])
        return self.grad
