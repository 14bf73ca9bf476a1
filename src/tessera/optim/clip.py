"""The true global gradient norm, and clipping by it.

Every parameter is counted exactly once in the sum of squares:

- a TP-sharded parameter (``param.tensor_parallel``): each TP rank adds its own slice;
- a TP-replicated parameter (norms, row-parallel biases, position embeddings): only TP rank 0
  adds it (the others hold the same tensor);
- a tied embedding's copy on the last pipeline stage (``param.shared_embedding``): skipped, the
  first stage counts it.

The partial sums are then all-reduced over the model-parallel group (tp x pp). Gradients are
already identical across data-parallel replicas, so dp needs no reduction.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from tessera.topology import Topology


def counts_once_here(param: nn.Parameter, tp_rank: int) -> bool:
    if getattr(param, "shared_embedding", False):
        return False
    return getattr(param, "tensor_parallel", False) or tp_rank == 0


def global_grad_norm(params: Iterable[nn.Parameter], topo: Topology) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None and counts_once_here(p, topo.tp_rank)]
    device = topo.device
    if grads:
        norms = torch._foreach_norm(grads, 2.0)
        sq = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]).square().sum()
    else:
        sq = torch.zeros((), device=device)
    if topo.group("mp") is not None:
        dist.all_reduce(sq, group=topo.group("mp"))
    return sq.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, topo: Topology) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / global_norm); returns the norm before clipping.
    ``max_norm = 0`` measures without clipping."""
    norm = global_grad_norm(params, topo)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
