"""Where each of this rank's numbers sits in the whole, unsharded model: the boxes a checkpoint
writes and reads.

A checkpoint holds every trainable parameter as the *whole* tensor a single-process model has
(``layers.3.attn.qkv.weight`` is ``[q + k + v, hidden]`` as at tp=1; the embedding and output
layer have ``model.vocab_size`` rows, without TP padding), in fp32: the optimizer's main
parameters, which the 16-bit model is rounded from. Beside them Adam's two moments, whole
tensors of the same shapes. Each rank contributes the boxes (offsets and sizes in the whole
tensor) it owns, so that every number is written exactly once:

- TP: a column-parallel layer's rows (each fused part, q / k / v or gate / up, split on its
  own: :class:`~tessera.tensor_parallel.layers.ColumnParallelLinear`), a row-parallel weight's
  columns, the vocabulary's rows (padding rows are not saved: they are zeros, never used).
  A parameter replicated over TP (norms, row-parallel biases) is written by TP rank 0.
- dp, zero 0: whole parameters, written by dp rank 0. zero 1/2: each rank's shard of the flat
  buffer, a range of a parameter's elements, cut into at most three boxes (a partial row, whole
  rows, a partial row). zero 3: FSDP's shard, rows of dim 0 (torch.chunk's split).
- pp: each stage its own layers (the names are global layer indices); a last stage's copy of a
  tied embedding is not written (the first stage's is the same numbers).

Loading reads, for each box this rank holds in its own layout, whatever saved boxes overlap it
(torch.distributed.checkpoint's resharding): a checkpoint loads into any tp / pp / vpp / dp /
zero and any dtype. Boxes rather than DTensors because zero 1/2's flat shards are not
expressible as DTensor placements (checkpoint/dcp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from tessera.distributed.fsdp_fp8 import plain_shard
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class Shard:
    """One box of one whole tensor: ``tensor`` (a view of live storage; its shape is the box's)
    sits at ``offsets`` in the tensor ``key`` of shape ``shape``."""

    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: Tensor


@dataclass(frozen=True)
class Part:
    """Local rows ``[start, stop)`` of a TP-local tensor sit at ``shift`` (added to the local
    index, per dim) in the whole tensor of ``shape``; rows beyond the whole's are padding."""

    start: int
    stop: int
    shift: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """How one parameter's TP-local tensor maps into its whole tensor."""

    key: str
    shape: tuple[int, ...]  # the whole tensor's
    parts: tuple[Part, ...]
    writes: bool  # this TP rank writes it (False: a TP rank > 0 of a replicated parameter)


def placements(chunk: nn.Module, vocab_size: int, tp_rank: int) -> dict[str, Placement]:
    """Every trainable parameter of one model chunk (on TP rank ``tp_rank``), by its name in the
    chunk."""
    out: dict[str, Placement] = {}
    for mname, module in chunk.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                name = f"{mname}.{pname}" if mname else pname
                vocab = module is getattr(chunk, "output", None) or isinstance(module, VocabParallelEmbedding)
                out[name] = _placement(name, module, p, vocab_size if vocab else None, tp_rank)
    return out


def _placement(name: str, module: nn.Module, p: nn.Parameter, vocab_rows: int | None, tp_rank: int) -> Placement:
    local = tuple(p.shape)
    rows, zero = local[0], (0,) * len(local)
    if isinstance(module, ColumnParallelLinear):  # rows: each fused part split on its own
        parts, at = [], 0
        for j, mine in enumerate(module.local_sizes):
            whole_start = sum(module.output_sizes[:j])
            parts.append(Part(at, at + mine, (whole_start + tp_rank * mine - at, *zero[1:])))
            at += mine
        key = "embedding.weight" if getattr(p, "shared_embedding", False) else name
        return Placement(key, (vocab_rows or module.out_features, *local[1:]), tuple(parts), True)
    if isinstance(module, VocabParallelEmbedding):
        return Placement(name, (vocab_rows, *local[1:]), (Part(0, rows, (module.vocab_start, 0)),), True)
    if isinstance(module, RowParallelLinear) and p is module.weight:  # columns
        return Placement(name, (rows, local[1] * module.tp), (Part(0, rows, (0, tp_rank * local[1])),), True)
    if getattr(p, "tensor_parallel", False) and getattr(module, "tp", 1) != 1:
        raise ValueError(f"{name} is split over TP by a {type(module).__name__}, which checkpoints do not place")
    return Placement(name, local, (Part(0, rows, zero),), tp_rank == 0)


def place(placement: Placement, offsets: tuple[int, ...], box: Tensor, key_prefix: str) -> list[Shard]:
    """The whole-tensor shards of ``box``, a box of the TP-local tensor at ``offsets``."""
    out = []
    r0, n = offsets[0], box.shape[0]
    for part in placement.parts:
        lo, hi = max(r0, part.start), min(r0 + n, part.stop)
        hi = min(hi, placement.shape[0] - part.shift[0])  # padding rows: not in the whole tensor
        if lo >= hi:
            continue
        whole = (lo + part.shift[0], *(o + s for o, s in zip(offsets[1:], part.shift[1:])))
        out.append(Shard(key_prefix + placement.key, placement.shape, whole, box[lo - r0:hi - r0]))
    return out


def flat_boxes(shape: tuple[int, ...], start: int, flat: Tensor) -> list[tuple[tuple[int, ...], Tensor]]:
    """``flat`` holds elements ``[start, start + len)`` of a row-major tensor of ``shape`` (1-D or
    2-D): the same elements as at most three boxes, (offsets, view of ``flat``)."""
    stop = start + flat.numel()
    if len(shape) == 1:
        return [((start,), flat)] if stop > start else []
    if len(shape) != 2:
        raise ValueError(f"checkpoint shards cover 1-D and 2-D parameters, not shape {shape}")
    cols = shape[1]
    boxes = []
    at = start
    while at < stop:
        row, col = divmod(at, cols)
        if col or stop - at < cols:  # a partial row
            end = min(stop, (row + 1) * cols)
            boxes.append(((row, col), flat[at - start:end - start].view(1, end - at)))
        else:  # whole rows
            end = at + (stop - at) // cols * cols
            boxes.append(((row, 0), flat[at - start:end - start].view(-1, cols)))
        at = end
    return boxes


def fsdp_rows(param: Tensor, dp_size: int, dp_rank: int) -> tuple[int, Tensor]:
    """(first row, local tensor) of an FSDP2 parameter sharded on dim 0 the way torch.chunk
    splits it; a plain tensor also where FSDP gathers the parameter in fp8 (the same storage)."""
    local = plain_shard(param.to_local())
    rows = param.shape[0]
    per = -(-rows // dp_size)
    first = min(dp_rank * per, rows)
    if local.shape[0] != max(0, min(rows, first + per) - first):
        raise ValueError(f"an FSDP shard of {local.shape[0]} rows on dp rank {dp_rank}: expected torch.chunk's "
                         f"split of {rows} rows over {dp_size}")
    return first, local


def model_shards(chunks: list[nn.Module], vocab_size: int, tp_rank: int) -> list[Shard]:
    """Every parameter of this rank's chunks as the boxes of the whole tensors it holds, views of
    the parameters: what loading a model without its optimizer reads (generation, evaluation)."""
    out: list[Shard] = []
    for chunk in chunks:
        places = placements(chunk, vocab_size, tp_rank)
        for name, p in chunk.named_parameters():
            if name in places:
                out.extend(place(places[name], (0,) * p.ndim, p.detach(), "model."))
    return [s for s in out if s.tensor.numel()]


def optimizer_shards(chunks: list[nn.Module], optimizer, vocab_size: int, tp_rank: int, dp_rank: int,
                     dp_size: int, moments: dict[Tensor, tuple[Tensor, Tensor]], *, saving: bool) -> list[Shard]:
    """This rank's shards of the main parameters (``model.``) and Adam's moments
    (``optim.exp_avg.``, ``optim.exp_avg_sq.``): ``moments`` maps each optimizer tensor to its
    two moments (the live ones to save, zeros to load into). ``saving``: only the shards this
    rank writes (each number once); loading: every shard it holds."""
    where = {}
    for chunk in chunks:
        places = placements(chunk, vocab_size, tp_rank)
        for name, p in chunk.named_parameters():
            if name in places:
                where[p] = places[name]
    out: list[Shard] = []

    def add(param: Tensor, boxes: list, replica: bool) -> None:
        placement = where[param]
        if saving and (replica or not placement.writes or getattr(param, "shared_embedding", False)):
            return
        for offsets_and_views, prefix in boxes:
            for offsets, view in offsets_and_views:
                out.extend(place(placement, offsets, view, prefix))

    if hasattr(optimizer, "pieces"):  # zero 0-2: pieces of the flat buffers' ranges
        for tensor, i, part, param in optimizer.pieces:
            rng = optimizer.dp.ranges[i]
            start = rng.lo + part.start - rng.buffer.param_range(param)[0]
            m, v = moments[tensor]
            add(param, [(flat_boxes(tuple(param.shape), start, x.detach()), prefix) for x, prefix in
                        ((optimizer.mains[i][part], "model."), (m, "optim.exp_avg."), (v, "optim.exp_avg_sq."))],
                replica=not optimizer.sharded and dp_rank != 0)
    else:  # zero 3: FSDP's row shards
        for param in optimizer.params:
            first, local = fsdp_rows(param, dp_size, dp_rank)
            m, v = moments[param]
            at = (first, *(0,) * (local.ndim - 1))
            add(param, [([(at, x.detach())], prefix) for x, prefix in
                        ((local, "model."), (m.to_local(), "optim.exp_avg."), (v.to_local(), "optim.exp_avg_sq."))],
                replica=False)
    return [s for s in out if s.tensor.numel()]


__all__ = ["Shard", "Placement", "placements", "place", "flat_boxes", "fsdp_rows", "model_shards", "optimizer_shards"]
