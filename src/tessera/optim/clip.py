"""The true global gradient norm, and the clipping factor it gives.

Every parameter is counted exactly once in the sum of squares:

- a TP-sharded parameter (``param.tensor_parallel``): each TP rank adds its own slice;
- a TP-replicated parameter (norms, row-parallel biases, position embeddings): only TP rank 0
  adds it (the others hold the same tensor);
- a tied embedding's copy on the last pipeline stage (``param.shared_embedding``): skipped, the
  first stage counts it.

The partial sums are then all-reduced over the model-parallel group (tp x pp), and over dp too
when each dp rank holds a different shard of the gradients (zero >= 1); replicated gradients
(zero=0) are identical across dp and need no dp reduction.

Heterogeneous stages (``topo.heterogeneous``): each stage has its own dp, so the sum runs over
every rank at once, the dp replicas of an unsharded gradient (zero=0) adding theirs on dp rank 0 only.

The gradients come as ``(grad, param)`` pairs: ``grad`` is what the optimizer will use (a whole
gradient or this rank's shard of it) and ``param`` says how to count it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.topology import Topology


def counts_once_here(param: nn.Parameter, tp_rank: int) -> bool:
    if getattr(param, "shared_embedding", False):
        return False
    return getattr(param, "tensor_parallel", False) or tp_rank == 0


Grads = list[tuple[torch.Tensor, nn.Parameter]]


def global_grad_norm(grads: Grads, topo: Topology, sharded: bool = False) -> torch.Tensor:
    return grad_norm_and_nonfinite(grads, topo, sharded)[0]


def grad_norm_and_nonfinite(grads: Grads, topo: Topology, sharded: bool = False,
                            count_nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global norm and, with ``count_nonfinite``, how many of the local gradients over the
    same ranks hold an inf or nan, counted or not in the norm (a tp rank > 0's copy of a
    replicated gradient, the last stage's tied embedding): one more number in the same
    all-reduce. (At zero=0 dp replicas are not in it: the caller adds theirs.)"""
    device = topo.device

    def norms(part: list[torch.Tensor]) -> torch.Tensor:
        # in fp32 whatever the gradients' dtype: an fp16 norm overflows past 65504 (inf, so the
        # clipping factor zeroed every gradient) and a bf16 one is off by up to 0.4 %
        if not part:
            return torch.zeros(0, device=device)
        return torch.stack([n.to(device=device) for n in torch._foreach_norm(part, 2.0, dtype=torch.float32)])

    counted = norms([g for g, p in grads if counts_once_here(p, topo.tp_rank)])
    sq = counted.square().sum()
    if count_nonfinite:
        others = norms([g for g, p in grads if not counts_once_here(p, topo.tp_rank)])
        bad = (~torch.isfinite(counted)).sum() + (~torch.isfinite(others)).sum()
        sq = torch.stack([sq, bad.float()])
    if topo.heterogeneous:  # ("mp" is every rank: each stage's dp replicas of a gradient count once)
        if not sharded and topo.dp_rank > 0:
            sq = sq * torch.tensor([0.0, 1.0], device=device) if count_nonfinite else sq * 0.0
        if topo.group("mp") is not None:
            dist.all_reduce(sq, group=topo.group("mp"))
        return (sq[0].sqrt(), sq[1]) if count_nonfinite else (sq.sqrt(), None)
    for axis in ("mp", "dp_cp") if sharded else ("mp",):
        if topo.group(axis) is not None:
            dist.all_reduce(sq, group=topo.group(axis))
    return (sq[0].sqrt(), sq[1]) if count_nonfinite else (sq.sqrt(), None)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor min(1, max_norm / norm) that clipping multiplies every gradient by (a tensor,
    so no host sync); None when ``max_norm = 0`` (no clipping). The optimizers apply it: at zero
    0-2 inside the fused AdamW kernel on CUDA (no extra pass over the gradients), at zero=3 and
    on a CPU as one foreach multiply."""
    if not max_norm >= 0:  # (NaN too: it made every gradient NaN; a negative one turned clipping off)
        raise ValueError(f"max_norm is the gradient norm to clip to, >= 0 (0: no clipping), not {max_norm}")
    if max_norm == 0:
        return None
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
