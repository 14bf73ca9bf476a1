"""A micro-batch pair's second backward adding its gradients on the side stream
(distributed/side_adds.py): which gradients are the second's, and the ordering of two adds into
one main gradient, with stand-in streams and events that log what waits for what (the CUDA run
is the GPU test of micro-batch pairs)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera.distributed.side_adds import MarkStart, SideAdds
from tessera.testing import run_ranks
from tessera.topology import Topology


class _Stream:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits for {event.name}@{event.at}")


def _stand_ins(log: list[str]):
    """SideAdds' stand-in event factory and stream context, logging records and stream switches."""
    names = iter(["side_done", "step_done"])

    class Event:
        def __init__(self):
            self.name, self.at = next(names), None

        def record(self, stream) -> None:
            self.at = len([line for line in log if line.startswith("add")])  # adds logged so far
            log.append(f"{self.name} recorded on {stream.name}")

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(f"to {stream.name}")
        yield
        log.append(f"back from {stream.name}")
    return Event, on_stream


def test_whichever_add_comes_second_waits_for_the_first():
    log: list[str] = []
    event, on_stream = _stand_ins(log)
    step, side = _Stream("step", log), _Stream("side", log)
    adds = SideAdds(step, side, event=event, on_stream=on_stream)
    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    # a: the side's add first, then the step's, which waits for it
    with adds.side_add(a):
        log.append("add a on side")
    adds.before_step_add(a)
    log.append("add a on step")
    # b: the step's add first, then the side's, which waits for an event recorded on the step's stream
    adds.before_step_add(b)
    log.append("add b on step")
    with adds.side_add(b):
        log.append("add b on side")
    # c: only the step's add, nothing to wait for; a reduction then waits for the side's adds once
    adds.before_step_add(c)
    log.append("add c on step")
    adds.step_waits()
    adds.step_waits()
    assert log == [
        "to side", "add a on side", "back from side", "side_done recorded on side",
        "step waits for side_done@1", "add a on step",
        "add b on step", "step_done recorded on step", "side waits for step_done@3",
        "to side", "add b on side", "back from side", "side_done recorded on side",
        "add c on step", "step waits for side_done@4"]


def _routing_worker(rank: int, world: int) -> dict:
    """Two backwards over one DataParallel (dp = ``world``), the second marked: its gradients go
    through the side adds (the stand-in streams log them), the first's not; the main gradients,
    and their reduction, are those of the run without side adds."""
    from tessera.distributed.data_parallel import DataParallel

    topo = Topology.build()
    out = {}
    for with_side in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        dp = DataParallel([model], topo, zero=1, bucket_size=10)
        dp.start_step(2)
        xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(2)]
        log: list[str] = []
        first, second = (model(x).sum() for x in xs)
        if with_side:
            event, on_stream = _stand_ins(log)
            dp.side_adds = SideAdds(_Stream("step", log), _Stream("side", log), event=event, on_stream=on_stream)
            second = MarkStart.apply(second, dp.side_adds)
        first.backward()
        second.backward()
        dp.finish_grad_sync()
        dp.side_adds = None
        out[with_side] = ([rng.grad.clone() for rng in dp.ranges], log)
    return out


def test_the_second_backwards_gradients_are_added_on_the_side_and_reduced_after():
    for plain, (grads, log) in ((o[False][0], o[True]) for o in run_ranks(_routing_worker, 2, timeout=120)):
        for g, h in zip(grads, plain):
            assert torch.equal(g, h)
        assert log.count("to side") == 4  # the second's four gradients, each on the side stream
        assert log.count("side_done recorded on side") == 4
        # the first's adds came first: each side add waited for the step's stream
        assert log.count("step_done recorded on step") == 4
        # the reductions read the buffers after the side's adds: after the last side add the step's
        # stream waited for it, and never twice for the same adds
        events = [line for line in log if line.startswith(("step waits", "side_done recorded"))]
        assert events[-1].startswith("step waits")
        assert all(not (x.startswith("step waits") and y.startswith("step waits")) for x, y in zip(events, events[1:]))
