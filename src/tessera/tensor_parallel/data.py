"""Broadcast a batch inside the TP group: only TP rank 0 reads data, the others receive it.

Two broadcasts: a small header (keys, shapes, dtypes) and then each tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.tensor_parallel.mappings import Group, group_rank, group_size


def broadcast_batch(batch: dict[str, Tensor] | None, group: Group, src: int,
                    device: torch.device) -> dict[str, Tensor]:
    """``batch`` is read on the TP source rank (global rank ``src``) and ``None`` elsewhere;
    every rank of ``group`` returns the same dict of tensors on ``device``."""
    if group_size(group) == 1:
        assert batch is not None, "the only TP rank must read the batch"
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    is_src = group_rank(group) == 0
    if is_src and batch is None:
        raise ValueError("TP rank 0 must provide the batch")
    header = [[(k, tuple(v.shape), v.dtype) for k, v in batch.items()] if is_src else None]
    dist.broadcast_object_list(header, src=src, group=group, device=device)
    out = {}
    for key, shape, dtype in header[0]:
        t = batch[key].to(device).contiguous() if is_src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        out[key] = t
    return out
