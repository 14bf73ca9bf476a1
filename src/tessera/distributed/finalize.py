"""After backward, make every gradient final before the optimizer step.

The data-parallel reduction has happened by now (``DataParallel.finish_grad_sync`` or FSDP's
post-backward); what is left are the two reductions over other axes, done on the gradients the
optimizer will use (whole, or this rank's dp shard, which is laid out identically on every rank
these groups join):

1. sequence parallel: parameters replicated over TP but applied to a sequence slice
   (``param.sequence_parallel``: norms, row-parallel biases) hold partial sums: all-reduce over tp.
2. tied embeddings across pipeline stages (``param.tied_across_stages``, ``embedding`` group):
   all-reduce the two copies' gradients so they stay identical. Under ``DataParallel`` at dp=1
   (zero 0/1) this ran already, overlapped with the end of backward (its ``tied_reduced``).

Sums commute, so doing these after the dp reduction gives the same result as before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tessera.topology import Topology

Grads = list[tuple[Tensor, nn.Parameter]]


def _all_reduce_coalesced(grads: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """One all-reduce of all ``grads`` flattened together (grouped by dtype). 16-bit gradients
    are summed in fp32 and rounded once (a ring over more than two ranks would round per hop);
    these are small (norms, biases, the tied embedding), so the wider wire costs little."""
    if group is None or not grads:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():
        flat = _flatten_dense_tensors(same)
        if dtype in (torch.bfloat16, torch.float16):
            flat = flat.float()
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(reduced)


def finalize_model_grads(grads: Grads, topo: Topology, *, done) -> None:
    """``grads``: (gradient, parameter) pairs, every parameter of this rank in a fixed order.
    ``done``: tied parameters whose sum over the embedding group already ran, overlapped with
    backward (``DataParallel.tied_reduced``, the same on both ends of the group; ``()`` for
    gradients of plain autograd). Required: a caller that forgot it would sum them twice."""
    _all_reduce_coalesced([g for g, p in grads if getattr(p, "sequence_parallel", False)], topo.group("tp"))
    # Both ends of the embedding group must join this all-reduce, so grads holds every tied copy.
    _all_reduce_coalesced([g for g, p in grads if getattr(p, "tied_across_stages", False) and p not in done],
                          topo.group("embedding"))


def param_grads(model: nn.Module) -> Grads:
    """``(param.grad, param)`` for every trainable parameter, zeros where backward left none:
    the pairs for a model trained without tessera's data-parallel buffers (tests, tools)."""
    out = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append((p.grad, p))
    return out
