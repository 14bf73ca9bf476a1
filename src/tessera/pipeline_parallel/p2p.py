"""Point-to-point between pipeline stages, with a shape handshake.

NCCL matches the messages on one communicator in the order they are posted, and with a bound
device (``init_process_group(device_id=...)``, as tessera launches) a group's point-to-point
messages share that group's one communicator and stream. So messages that the two ends would
post in different orders must not share a group: each (stream, sending pipeline rank) gets its
own group (``F`` activations forward, ``B`` gradients backward), so every communicator carries one
direction of one stream from one sender, in an order both ends agree on (the schedule's
sequence order); this also covers pp=2 and odd pp rings, where neighbours send to each other
in both directions. gloo matches by tag; the tag here is the message's micro-batch and chunk.

Shapes are negotiated, not assumed: at the first message of a step to a peer on a stream, the
sender first sends a small header (number of dims, sizes, dtype) and the receiver allocates from
it; later messages of the step reuse it, so their receives are posted at once and overlap with
compute. A new step renegotiates (a different sequence length, a smaller last batch). A tensor
whose shape differs from its step's header is refused with an error naming both shapes.

With ``keep_shapes`` (the trainer, whose micro-batches keep one shape for the whole run:
``DataFeed``) only the run's first message per stream and peer carries a header. Reading a
header is the one thing that makes the host wait for the GPU in a pipeline step (the receiver
allocates from it): at every step's first receive the host would stop launching until the peer's
GPU had produced that message. A later tensor of another shape is still refused by its sender.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.topology import Topology

HEADER_LEN = 8  # [ndim, dtype code, up to 6 sizes]
HEADER_TAG = 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
STREAMS = ("F", "B")  # activations forward, gradients backward


class ShapeError(RuntimeError):
    pass


def _header(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.dim() > HEADER_LEN - 2 or t.dtype not in DTYPES:
        raise ShapeError(f"cannot send a {t.dim()}-d {t.dtype} tensor between pipeline stages")
    values = [t.dim(), DTYPES.index(t.dtype), *t.shape] + [0] * (HEADER_LEN - 2 - t.dim())
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[2: 2 + values[0]]), DTYPES[values[1]]


@dataclass
class PendingRecv:
    """A receive posted early; ``wait()`` returns the tensor."""

    p2p: "P2P"
    stream: str
    peer: int
    tag: int
    work: object | None = None
    buffer: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.work is None:  # the step's header had not arrived when this was posted
            self.p2p._post_payload(self)
        self.work.wait()
        return self.buffer


class P2P:
    """Sends and receives between this rank and its pipeline neighbours (pipeline ranks)."""

    def __init__(self, topo: Topology, match_in_order: bool = False, keep_shapes: bool = False):
        """``match_in_order``: send every message with one tag, so gloo matches them in posting
        order as NCCL does; tests use it to catch ordering mistakes on CPU. ``keep_shapes``: the
        shapes negotiated at the first step hold for every later step (both ends must agree)."""
        self.device = topo.device
        self.match_in_order, self.keep_shapes = match_in_order, keep_shapes
        self.global_ranks = topo.ranks_of("pp")
        if topo.pp > 1 and dist.get_backend() == "nccl" and \
                dist.distributed_c10d._get_default_group().bound_device_id is None:
            raise RuntimeError("pipeline point-to-point on NCCL needs init_process_group(..., device_id=...) "
                               "so that every group's communicator exists before the first message")
        # (stream, sending pipeline rank) -> group; every rank makes every group.
        self.groups: dict[tuple[str, int], dist.ProcessGroup] = {}
        for key in [(stream, sender) for stream in STREAMS for sender in range(topo.pp)]:
            self.groups[key] = topo.new_groups(topo.all_ranks_along("pp"))
        self.rank = topo.pp_rank
        self._sends: list[tuple[object, torch.Tensor | None]] = []
        self.failed: str | None = None  # why this channel is unusable (fail())
        self.new_step(renegotiate=True)
        self._connect(topo.pp_rank, topo.pp)

    def _connect(self, rank: int, pp: int) -> None:
        """Exchange one value with both neighbours in every group, all pipeline ranks at once.

        NCCL connects two ranks at their first message, blocking the CPU until the peer arrives;
        done lazily mid-schedule, that wait can deadlock against a GPU busy in another receive.
        So every pair connects here, up front, in one batched call per group."""
        if pp == 1:
            return
        for group in self.groups.values():
            buf = torch.zeros(4, device=self.device)
            nxt, prev = self.global_ranks[(rank + 1) % pp], self.global_ranks[(rank - 1) % pp]
            ops = [dist.P2POp(dist.isend, buf[0:1], nxt, group), dist.P2POp(dist.irecv, buf[1:2], prev, group)]
            if pp > 2:
                ops += [dist.P2POp(dist.isend, buf[2:3], prev, group), dist.P2POp(dist.irecv, buf[3:4], nxt, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def _tag(self, tag: int) -> int:
        return 0 if self.match_in_order else tag

    def fail(self, reason: str) -> None:
        """A step failed with messages of it still posted or due on this rank: they would pair
        with a later step's, so every later use of this channel raises (the run must restart)."""
        self.failed = reason

    def _usable(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the pipeline's point-to-point channel is unusable: an earlier step failed midway "
                               f"({self.failed}) with messages still posted or due, which would pair with this "
                               "step's; restart the run (a new P2P) instead of retrying the step")

    def new_step(self, renegotiate: bool = False) -> None:
        """Forget the negotiated shapes: the next message on each stream carries a header. With
        ``keep_shapes``, keep them unless ``renegotiate`` (both ends must pass the same: sampling
        from the trained model sends other shapes over the trainer's P2P)."""
        self._usable()
        if self.keep_shapes and not renegotiate:
            return
        self._sent_shape: dict[tuple[str, int], tuple] = {}
        self._recv_shape: dict[tuple[str, int], tuple] = {}  # header in flight, or (shape, dtype)
        self._deferred: dict[tuple[str, int], list[PendingRecv]] = {}  # waiting for that header

    # -- send -----------------------------------------------------------------------------------
    def send(self, stream: str, peer: int, tag: int, tensor: torch.Tensor) -> None:
        """Post an asynchronous send of ``tensor`` to pipeline rank ``peer``."""
        self._usable()
        key, signature = (stream, peer), (tuple(tensor.shape), tensor.dtype)
        dst, group = self.global_ranks[peer], self.groups[(stream, self.rank)]
        if key not in self._sent_shape:
            header = _header(tensor, self.device)
            self._sends.append((dist.isend(header, dst, group=group, tag=self._tag(HEADER_TAG)), header))
            self._sent_shape[key] = signature
        elif self._sent_shape[key] != signature:
            when = ("at the run's first step (shapes are kept for the run: every micro-batch of a "
                    "training run must have one shape)" if self.keep_shapes
                    else "for this step; all micro-batches of a step must have one shape")
            raise ShapeError(f"pipeline {stream} message to stage {peer}: shape {signature[0]} {signature[1]} "
                             f"differs from {self._sent_shape[key][0]} {self._sent_shape[key][1]} negotiated {when}")
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, dst, group=group, tag=self._tag(tag)), tensor))

    def reap(self) -> None:
        """Drop finished sends, releasing their buffers."""
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    # -- receive --------------------------------------------------------------------------------
    def recv(self, stream: str, peer: int, tag: int) -> PendingRecv:
        """Post a receive from pipeline rank ``peer``; the payload is posted as soon as the shape
        is known (now, unless this is the step's first message on this stream)."""
        self._usable()
        key = (stream, peer)
        if key not in self._recv_shape:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, self.global_ranks[peer], group=self.groups[(stream, peer)],
                              tag=self._tag(HEADER_TAG))
            self._recv_shape[key] = (work, header)
            self._deferred[key] = []
        pending = PendingRecv(self, stream, peer, tag)
        if key in self._deferred:
            self._deferred[key].append(pending)
        else:
            self._post(pending, *self._recv_shape[key])
        return pending

    def _post_payload(self, pending: PendingRecv) -> None:
        """The header arrives: post every receive deferred on it, in the order they were asked
        for (NCCL matches messages between two ranks in order)."""
        key = (pending.stream, pending.peer)
        work, header = self._recv_shape[key]
        work.wait()
        self._recv_shape[key] = shape = _decode(header)
        for waiting in self._deferred.pop(key):
            self._post(waiting, *shape)

    def _post(self, pending: PendingRecv, shape: tuple, dtype: torch.dtype) -> None:
        pending.buffer = torch.empty(shape, dtype=dtype, device=self.device)
        pending.work = dist.irecv(pending.buffer, self.global_ranks[pending.peer],
                                  group=self.groups[(pending.stream, pending.peer)], tag=self._tag(pending.tag))
