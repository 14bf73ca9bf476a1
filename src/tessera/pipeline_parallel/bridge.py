"""The bridge between pipeline stages on grids of different shapes (heterogeneous layouts,
stage_topology.py): the executor's point-to-point, when neighbouring stages differ in tp or dp.

A rank's activation is its share of the pipeline micro-batch's hidden stream ``[s, b, h]``: batch
rows ``dp_rank * b/dp`` onwards, and under sequence parallelism (stage tp > 1) its tp slice of
the sequence, else the whole sequence. Sending stage ``s``'s activations to the next stage is a
redistribution: every receiving rank assembles its own share from the pieces (intersections of
two shares) that the sending ranks holding them send point-to-point. A piece the sending stage
replicates over tp (no sequence parallelism) comes from its tp rank ``t' % tp`` for receiving tp
rank ``t'``. Gradients go back the same way with the stages' roles swapped: every rank holds the
whole gradient of its share (copies of a replicated share hold equal gradients: a TP layer
all-reduces its input gradient), so the backward is the same redistribution towards the earlier
grid, with no sum. Between equal grids each share is one piece, sent from and received into the
tensors themselves (no copies).

Shapes are negotiated as P2P's: the sending stage's first rank sends the global ``[s, b, h]`` and
dtype to every receiving rank at the first message of a step (of the run, with ``keep_shapes``);
both ends then derive the same list of pieces. Messages of one direction from one stage share a
group (the two stages' ranks), so NCCL meets them in the schedule's order; gloo matches by tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from tessera.pipeline_parallel.p2p import HEADER_LEN, HEADER_TAG, P2P, ShapeError, _decode, _header
from tessera.stage_topology import StageGrid, StageTopology

Box = tuple[tuple[int, int], tuple[int, int]]  # (sequence range, batch range) of the global [s, b, h]


def share(grid: StageGrid, stage: int, tp_rank: int, dp_rank: int, seq: int, batch: int, sp: bool) -> Box:
    """The box of the global ``[seq, batch, h]`` that a rank of ``stage`` holds."""
    tp, rows = grid.stage_tp[stage], batch // grid.stage_dp[stage]
    part = seq // tp if sp and tp > 1 else seq
    first = tp_rank * part if sp and tp > 1 else 0
    return (first, first + part), (dp_rank * rows, (dp_rank + 1) * rows)


def _meet(a: Box, b: Box) -> Box | None:
    box = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


@lru_cache(maxsize=64)
def pieces(grid: StageGrid, src: int, dst: int, seq: int, batch: int, sp: bool) -> tuple[tuple[int, int, Box], ...]:
    """Every ``(sending rank, receiving rank, box)`` that moves stage ``src``'s shares of a global
    ``[seq, batch, h]`` to stage ``dst``'s, in one order both ends agree on."""
    out = []
    src_tp, src_dp = grid.stage_tp[src], grid.stage_dp[src]
    split = sp and src_tp > 1  # the sending shares are sequence slices (else replicated over tp)
    for d_dp in range(grid.stage_dp[dst]):
        for d_tp in range(grid.stage_tp[dst]):
            want = share(grid, dst, d_tp, d_dp, seq, batch, sp)
            for s_dp in range(src_dp):
                for s_tp in (range(src_tp) if split else [d_tp % src_tp]):
                    box = _meet(want, share(grid, src, s_tp, s_dp, seq, batch, sp))
                    if box is not None:
                        out.append((grid.rank_of(src, s_tp, s_dp), grid.rank_of(dst, d_tp, d_dp), box))
    return tuple(out)


def _local(box: Box, mine: Box) -> tuple[slice, slice]:
    """``box`` as slices of the tensor holding ``mine``."""
    return tuple(slice(lo - base, hi - base) for (lo, hi), (base, _) in zip(box, mine))


@dataclass
class BridgeRecv:
    """A receive posted early; ``wait()`` returns this rank's share, assembled."""

    bridge: "Bridge"
    stream: str
    peer: int
    tag: int
    works: list | None = None
    buffer: torch.Tensor | None = None
    parts: list[tuple[tuple[slice, slice], torch.Tensor]] = field(default_factory=list)  # (where, piece)

    def wait(self) -> torch.Tensor:
        if self.works is None:  # the step's header had not arrived when this was posted
            self.bridge._post_payload(self)
        for work in self.works:
            work.wait()
        for where, piece in self.parts:
            self.buffer[where] = piece
        self.parts = []
        return self.buffer


class Bridge(P2P):
    """Sends and receives between this rank's stage and its neighbours (pipeline ranks), each on
    its own grid; the executor's interface of :class:`P2P` (``send``, ``recv``, ``new_step``, ...)."""

    def __init__(self, topo: StageTopology, sequence_parallel: bool, match_in_order: bool = False,
                 keep_shapes: bool = False):
        self.device, self.grid, self.me = topo.device, topo.grid, topo.rank
        self.match_in_order, self.keep_shapes, self.sp = match_in_order, keep_shapes, sequence_parallel
        self.rank = topo.pp_rank
        self.coords = topo.coords
        # (stream, sending stage) -> group of the sending and receiving stage; every rank makes every group
        self.groups: dict[tuple[str, int], dist.ProcessGroup | None] = {}
        for stream, step in (("F", 1), ("B", -1)):
            for sender in range(self.grid.pp):
                if 0 <= sender + step < self.grid.pp:
                    members = sorted(self.grid.stage_ranks(sender) + self.grid.stage_ranks(sender + step))
                    self.groups[(stream, sender)] = topo.new_groups([members])
        self._sends: list[tuple[object, torch.Tensor | None]] = []
        self.failed: str | None = None
        self.new_step(renegotiate=True)
        self._connect()

    def _connect(self) -> None:
        """Exchange one value between every sending and receiving rank of each group, up front
        (NCCL connects a pair at its first message, blocking the host: mid-schedule, that can
        deadlock against a GPU busy in another receive). Groups in one order on every rank."""
        for (stream, sender), group in self.groups.items():
            if group is None:
                continue
            receiver = sender + (1 if stream == "F" else -1)
            peers = self.grid.stage_ranks(receiver if self.rank == sender else sender)
            buf = torch.zeros(2 * len(peers), device=self.device)
            ops = []
            for i, peer in enumerate(peers):
                ops += [dist.P2POp(dist.isend, buf[2 * i:2 * i + 1], peer, group),
                        dist.P2POp(dist.irecv, buf[2 * i + 1:2 * i + 2], peer, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _share(self, stage: int, tp_rank: int, dp_rank: int, shape: tuple) -> Box:
        return share(self.grid, stage, tp_rank, dp_rank, shape[0], shape[1], self.sp)

    # -- send -----------------------------------------------------------------------------------
    def send(self, stream: str, peer: int, tag: int, tensor: torch.Tensor) -> None:
        """Post the sends of this rank's pieces of ``tensor`` (its share) to stage ``peer``'s ranks."""
        self._usable()
        if tensor.dim() < 2:
            raise ShapeError(f"the bridge carries [s, b, ...] tensors, not a {tuple(tensor.shape)} one")
        c, grid = self.coords, self.grid
        tp, dp = grid.stage_tp[self.rank], grid.stage_dp[self.rank]
        shape = (tensor.shape[0] * (tp if self.sp and tp > 1 else 1), tensor.shape[1] * dp, *tensor.shape[2:])
        key, signature, group = (stream, peer), (tuple(tensor.shape), tensor.dtype), self.groups[(stream, self.rank)]
        if key not in self._sent_shape:
            if self.me == grid.offset(self.rank):  # the stage's first rank tells every receiver the global shape
                header = _header(torch.empty(shape, dtype=tensor.dtype, device="meta"), self.device)
                for dst in grid.stage_ranks(peer):
                    self._sends.append((dist.isend(header, dst, group=group, tag=self._tag(HEADER_TAG)), header))
            self._sent_shape[key] = signature
        elif self._sent_shape[key] != signature:
            raise ShapeError(f"pipeline {stream} message to stage {peer}: shape {signature[0]} {signature[1]} "
                             f"differs from {self._sent_shape[key][0]} {self._sent_shape[key][1]} negotiated")
        mine = self._share(self.rank, c.tp, c.dp, shape)
        for src, dst, box in pieces(grid, self.rank, peer, shape[0], shape[1], self.sp):
            if src == self.me:
                piece = tensor if box == mine else tensor[_local(box, mine)]
                piece = piece.contiguous()
                self._sends.append((dist.isend(piece, dst, group=group, tag=self._tag(tag)), piece))

    # -- receive --------------------------------------------------------------------------------
    def recv(self, stream: str, peer: int, tag: int) -> BridgeRecv:
        """Post the receives of this rank's share from stage ``peer``'s ranks (at once, unless
        this is the step's first message on this stream: then when the header is in)."""
        self._usable()
        key = (stream, peer)
        if key not in self._recv_shape:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, self.grid.offset(peer), group=self.groups[(stream, peer)],
                              tag=self._tag(HEADER_TAG))
            self._recv_shape[key] = (work, header)
            self._deferred[key] = []
        pending = BridgeRecv(self, stream, peer, tag)
        if key in self._deferred:
            self._deferred[key].append(pending)
        else:
            self._post(pending, *self._recv_shape[key])
        return pending

    def _post(self, pending: BridgeRecv, shape: tuple, dtype: torch.dtype) -> None:
        c, group = self.coords, self.groups[(pending.stream, pending.peer)]
        mine = self._share(self.rank, c.tp, c.dp, shape)
        local = tuple(hi - lo for lo, hi in mine) + tuple(shape[2:])
        mine_in = [(src, box) for src, dst, box in pieces(self.grid, pending.peer, self.rank, shape[0], shape[1],
                                                          self.sp) if dst == self.me]
        pending.buffer = torch.empty(local, dtype=dtype, device=self.device)
        pending.works = []
        for src, box in mine_in:
            if box == mine:  # the whole share in one piece: straight into the buffer
                target = pending.buffer
            else:
                target = torch.empty(tuple(hi - lo for lo, hi in box) + tuple(shape[2:]), dtype=dtype,
                                     device=self.device)
                pending.parts.append((_local(box, mine), target))
            pending.works.append(dist.irecv(target, src, group=group, tag=self._tag(pending.tag)))


__all__ = ["Bridge", "pieces", "share"]
