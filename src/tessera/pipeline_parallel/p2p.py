"""Point-to-point between pipeline stages, with a shape handshake.

Activations travel forward on one process group and their gradients backward on a second group
over the same ranks, so the two streams of messages never queue behind each other and each keeps
the same order on both ends (NCCL matches point-to-point messages in order; gloo by tag, and the
tag here is the message's micro-batch and chunk).

Shapes are negotiated, not assumed: at the first message of a step to a peer on a stream, the
sender first sends a small header (number of dims, sizes, dtype) and the receiver allocates from
it; later messages of the step reuse it, so their receives are posted at once and overlap with
compute. A new step renegotiates (a different sequence length, a smaller last batch). A tensor
whose shape differs from its step's header is refused with an error naming both shapes.
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

    def __init__(self, topo: Topology):
        self.device = topo.device
        self.groups = {"F": topo.group("pp"), "B": topo.group("pp_grad")}
        self.global_ranks = topo.ranks_of("pp")
        self._sends: list[tuple[object, torch.Tensor | None]] = []
        self.new_step()

    def new_step(self) -> None:
        """Forget the negotiated shapes: the next message on each stream carries a header."""
        self._sent_shape: dict[tuple[str, int], tuple] = {}
        self._recv_shape: dict[tuple[str, int], tuple | tuple[object, torch.Tensor]] = {}

    # -- send -----------------------------------------------------------------------------------
    def send(self, stream: str, peer: int, tag: int, tensor: torch.Tensor) -> None:
        """Post an asynchronous send of ``tensor`` to pipeline rank ``peer``."""
        key, signature = (stream, peer), (tuple(tensor.shape), tensor.dtype)
        dst, group = self.global_ranks[peer], self.groups[stream]
        if key not in self._sent_shape:
            header = _header(tensor, self.device)
            self._sends.append((dist.isend(header, dst, group=group, tag=HEADER_TAG), header))
            self._sent_shape[key] = signature
        elif self._sent_shape[key] != signature:
            raise ShapeError(f"pipeline {stream} message to stage {peer}: shape {signature[0]} {signature[1]} "
                             f"differs from {self._sent_shape[key][0]} {self._sent_shape[key][1]} negotiated "
                             "for this step; all micro-batches of a step must have one shape")
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, dst, group=group, tag=tag), tensor))

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
        key = (stream, peer)
        if key not in self._recv_shape:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, self.global_ranks[peer], group=self.groups[stream], tag=HEADER_TAG)
            self._recv_shape[key] = (work, header)
        pending = PendingRecv(self, stream, peer, tag)
        if not isinstance(self._recv_shape[key][0], dist.Work):
            self._post_payload(pending)
        return pending

    def _post_payload(self, pending: PendingRecv) -> None:
        key = (pending.stream, pending.peer)
        entry = self._recv_shape[key]
        if isinstance(entry[0], dist.Work):
            entry[0].wait()
            entry = self._recv_shape[key] = _decode(entry[1])
        shape, dtype = entry
        pending.buffer = torch.empty(shape, dtype=dtype, device=self.device)
        pending.work = dist.irecv(pending.buffer, self.global_ranks[pending.peer],
                                  group=self.groups[pending.stream], tag=pending.tag)
