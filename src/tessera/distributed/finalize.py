"""After the last micro-batch's backward, make every gradient final before the optimizer step.

1. data parallel: sum gradients over dp (the loss is already divided by the global token
   count, so the sum is the gradient of the global-batch mean). This is the simple, unbucketed
   version; the data-parallel issue replaces it with overlapped bucketed reduction.
2. sequence parallel: parameters replicated over TP but applied to a sequence slice
   (``param.sequence_parallel``: norms, row-parallel biases) hold partial sums: all-reduce over tp.
3. tied embeddings across pipeline stages (``param.tied_across_stages``, ``embedding`` group): all-reduce the two copies'
   gradients so they stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tessera.topology import Topology


def _all_reduce_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """One all-reduce of all ``grads`` flattened together (grouped by dtype)."""
    if group is None or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(reduced)


def finalize_model_grads(model: nn.Module, topo: Topology) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    _all_reduce_coalesced([p.grad for p in params], topo.group("dp"))
    _all_reduce_coalesced([p.grad for p in params if getattr(p, "sequence_parallel", False)], topo.group("tp"))
    # Both ends of the embedding group must join this all-reduce, even with no gradient here.
    tied = [p for p in model.parameters() if getattr(p, "tied_across_stages", False)]
    for p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _all_reduce_coalesced([p.grad for p in tied], topo.group("embedding"))
