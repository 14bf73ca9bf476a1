"""Broadcast a batch inside the TP group: only TP rank 0 reads data, the others receive it.

A small header (keys, shapes, dtypes) and then each tensor. The header is a pickled object
broadcast, which makes the host wait for the device; a caller that already knows it (the data
feed after its first step: the same keys and dtypes, shapes that follow the micro-batch count)
passes it, and then only the tensors travel. On CUDA the source copies through pinned memory
without waiting: a copy from pageable memory would first drain the stream, leaving the GPU idle
while the host prepares the next step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.tensor_parallel.mappings import Group, group_rank, group_size


Header = list[tuple[str, tuple[int, ...], torch.dtype]]


def batch_header(batch: dict[str, Tensor]) -> Header:
    """[(key, shape, dtype)] of a batch, in its order."""
    return [(k, tuple(v.shape), v.dtype) for k, v in batch.items()]


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device``; from the host to a GPU through pinned memory, not waiting."""
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def broadcast_batch(batch: dict[str, Tensor] | None, group: Group, src: int,
                    device: torch.device, header: Header | None = None) -> dict[str, Tensor]:
    """``batch`` is read on the TP source rank (global rank ``src``) and ``None`` elsewhere;
    every rank of ``group`` returns the same dict of tensors on ``device``. ``header``: the
    batch's ``batch_header`` where every rank knows it (the source checks its batch against it),
    or None to broadcast it first."""
    if group_size(group) == 1:
        assert batch is not None, "the only TP rank must read the batch"
        return {k: to_device(v, device) for k, v in batch.items()}
    is_src = group_rank(group) == 0
    if is_src and batch is None:
        raise ValueError("TP rank 0 must provide the batch")
    if header is None:
        box = [batch_header(batch) if is_src else None]
        dist.broadcast_object_list(box, src=src, group=group, device=device)
        header = box[0]
    elif is_src and batch_header(batch) != [(k, tuple(shape), dtype) for k, shape, dtype in header]:
        raise ValueError(f"the batch read on TP rank 0 has keys, shapes and dtypes {batch_header(batch)}, "
                         f"not the {header} the other TP ranks expect")
    out = {}
    for key, shape, dtype in header:
        t = to_device(batch[key], device).contiguous() if is_src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        out[key] = t
    return out
