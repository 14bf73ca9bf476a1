"""The validation loss: the model's mean loss per token over the validation data, in eval mode.

``train.eval_every`` steps (and after the last) the trainer reads the first ``train.eval_batches``
global batches of the validation split (the same samples every time, so the figures compare
across a run and across runs), runs each micro-batch forward through the pipeline (no backward,
no dropout, no gradients), and sums the loss and the loss tokens over the micro-batches and the
dp ranks: one figure, the same on every layout (tests/test_evaluate.py).

The forward walks the stages as sampling does (inference/generate.py): micro-batch by
micro-batch, each virtual stage receiving its input from the one before, with no overlap
between micro-batches. A validation loss is a small part of a run, and this keeps it out of the
schedules' action lists, whose executor is built around backward. Heterogeneous stages make the
same calls on the bridge (pipeline_parallel/bridge.py), which re-splits each activation.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from tessera.topology import Topology
from tessera.training.data_feed import DataFeed


def _forward(chunks, mb: dict, topo: Topology, p2p) -> torch.Tensor | None:
    """One micro-batch through this rank's chunks; its per-token loss [b, s] on the last stage."""
    pp, rank = topo.pp, topo.pp_rank
    last = pp * len(chunks) - 1
    packed = {k: mb[k] for k in ("position_ids", "document_ids") if k in mb}
    loss = None
    for c, chunk in enumerate(chunks):
        stage = c * pp + rank
        x = p2p.recv("F", (rank - 1) % pp, (stage - 1) // pp).wait() if stage > 0 else None
        out = chunk(tokens=mb["tokens"] if stage == 0 else None, hidden=x,
                    labels=mb["labels"] if stage == last else None, **packed)
        if stage < last:
            p2p.send("F", (rank + 1) % pp, c, out)
        else:
            loss = out
    return loss


@torch.no_grad()
def validation_loss(chunks, topo: Topology, feed: DataFeed, batches: int, p2p=None) -> float | None:
    """Mean loss per token over the first ``batches`` global batches of ``feed`` (read from its
    start); the figure on the last pipeline stage, None elsewhere. Every rank calls it."""
    feed.batches.consumed_samples = 0
    was_training = chunks[0].training
    for chunk in chunks:
        chunk.eval()
    device = topo.device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    if p2p is not None:
        p2p.new_step(renegotiate=True)  # (the trainer's next step renegotiates too)
    try:
        for _ in range(batches):
            for mb in feed.next():
                loss = _forward(chunks, mb, topo, p2p)
                if loss is not None:
                    mask = mb["loss_mask"]
                    total[0] += (loss.float() * mask).sum()
                    total[1] += mask.sum()
        if p2p is not None:
            p2p.wait_sends()
    finally:
        for chunk in chunks:
            chunk.train(was_training)
            for module in chunk.modules():  # zero=3: FSDP keeps a root unsharded after a forward,
                if isinstance(module, FSDPModule):  # waiting for a backward that never comes
                    module.reshard()
    if not topo.is_last_stage:
        return None
    group = topo.group("dp_scalars") or topo.group("dp_cp")
    if group is not None:
        torch.distributed.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp(min=1))


__all__ = ["validation_loss"]
