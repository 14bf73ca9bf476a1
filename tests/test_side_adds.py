"""A micro-batch pair's second backward adding its gradients on the side stream
(distributed/side_adds.py): which gradients are the second's, and the ordering of two adds into
one main gradient, with stand-in streams and events that log what waits for what (the CUDA run
is the GPU test of micro-batch pairs)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tessera.distributed.side_adds import MarkStart, SideAdds, used_more_than_once
from tessera.testing import run_ranks
from tessera.topology import Topology


class _Stream:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits for {event.name}@{event.at}")


def _stand_ins(log: list[str]):
    """SideAdds' stand-in event factory and stream context, logging records and stream switches."""

    class Event:
        def __init__(self):
            self.name, self.at = "side_done", None

        def record(self, stream) -> None:
            self.at = len([line for line in log if line.startswith("add")])  # adds logged so far
            log.append(f"{self.name} recorded on {stream.name}")

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(f"to {stream.name}")
        yield
        log.append(f"back from {stream.name}")
    return Event, on_stream


def test_the_step_waits_for_the_side_and_never_the_side_for_the_step():
    log: list[str] = []
    event, on_stream = _stand_ins(log)
    step, side = _Stream("step", log), _Stream("side", log)
    adds = SideAdds(step, side, event=event, on_stream=on_stream)
    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    # a: the second's add issued first runs on the side stream; the first's waits for it
    with adds.second_add(a):
        log.append("add a (second)")
    adds.before_step_add(a)
    log.append("add a (first)")
    # b: the first's add issued first; the second's then runs on the step's stream, after it
    adds.before_step_add(b)
    log.append("add b (first)")
    with adds.second_add(b):
        log.append("add b (second)")
    # c: only the first's add, nothing to wait for; a reduction then waits for the side's adds once
    with adds.second_add(c):
        log.append("add c (second)")
    adds.step_waits()
    adds.step_waits()
    assert log == [
        "to side", "add a (second)", "back from side", "side_done recorded on side",
        "step waits for side_done@1", "add a (first)",
        "add b (first)", "add b (second)",
        "to side", "add c (second)", "back from side", "side_done recorded on side",
        "step waits for side_done@5"]
    assert not any(line.startswith("side waits") for line in log)


def _routing_worker(rank: int, world: int) -> dict:
    """Two backwards over one DataParallel (dp = ``world``), the second marked, run in either
    order: the main gradients, and their reduction, are those of the run without side adds."""
    from tessera.distributed.data_parallel import DataParallel

    topo = Topology.build()
    out = {}
    for mode in ("plain", "second first", "first first"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        dp = DataParallel([model], topo, zero=1, bucket_size=10)
        dp.start_step(2)
        xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(2)]
        log: list[str] = []
        first, second = (model(x).sum() for x in xs)
        if mode != "plain":
            event, on_stream = _stand_ins(log)
            dp.side_adds = SideAdds(_Stream("step", log), _Stream("side", log), event=event, on_stream=on_stream)
            second = MarkStart.apply(second, dp.side_adds)
        for loss in ((second, first) if mode == "second first" else (first, second)):
            loss.backward()
        dp.finish_grad_sync()
        dp.side_adds = None
        out[mode] = ([rng.grad.clone() for rng in dp.ranges], log)
    return out


def test_the_second_backwards_gradients_are_added_on_the_side_and_reduced_after():
    for out in run_ranks(_routing_worker, 2, timeout=120):
        plain = out["plain"][0]
        for mode in ("second first", "first first"):
            for g, h in zip(out[mode][0], plain):
                torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)  # (the two adds in either order)
        # second first: its four gradients added on the side stream, the first's adds after
        # them (the step's stream waited once: the latest record covers the four), and no
        # reduction waits again; first first: the second's adds follow on the step's stream
        log = out["second first"][1]
        assert log.count("to side") == 4 and log.count("side_done recorded on side") == 4
        assert [line for line in log if line.startswith("step waits")] == ["step waits for side_done@0"]
        assert out["first first"][1] == []


def test_parameters_used_twice_are_found_and_added_on_the_steps_stream():
    """A tied weight (used by two ops of one micro-batch) gets its two gradients summed by
    autograd on its node's stream, the step's: ``used_more_than_once`` finds it (and nothing
    else), and the second backward's add of it stays on the step's stream."""
    torch.manual_seed(0)
    embed, inner = nn.Embedding(8, 4), nn.Linear(4, 4)
    tokens = torch.tensor([[1, 2, 3]])
    h = inner(embed(tokens))
    loss = (h @ embed.weight.t()).sum()  # the output layer tied to the embedding
    assert used_more_than_once(loss) == {embed.weight}
    assert used_more_than_once(inner(embed(tokens)).sum()) == set()
    log: list[str] = []
    event, on_stream = _stand_ins(log)
    adds = SideAdds(_Stream("step", log), _Stream("side", log), event=event, on_stream=on_stream,
                    step_only=used_more_than_once(loss))
    with adds.second_add(embed.weight):
        log.append("add tied (second)")
    with adds.second_add(inner.weight):
        log.append("add inner (second)")
    assert log == ["add tied (second)", "to side", "add inner (second)", "back from side", "side_done recorded on side"]


def test_used_more_than_once_counts_leaves_not_node_objects():
    """Autograd hands out a node's Python object anew where the last one died, so an object's
    id can come back for another node during the walk (on the GPU, an id-keyed count reported
    a dozen parameters of a 2-layer GPT as used twice, and missed the tied embedding in the
    pairs, session 19): counted per leaf, with every visited node held, only the leaf that two
    edges reach is found. Stand-in nodes make a fresh object per access, as autograd may."""

    class Leaf:
        pass

    class Accumulate:  # a fresh object on each access, dropped once the walk moves on
        def __init__(self, leaf):
            self.variable = leaf

    class Node:
        def __init__(self, children):
            self._children = children

        @property
        def next_functions(self):
            return tuple((Accumulate(c) if isinstance(c, Leaf) else c, 0) for c in self._children)

    leaves = [Leaf() for _ in range(40)]
    tied = leaves[0]
    chain = Node([tied, leaves[1]])
    for leaf in leaves[2:]:
        chain = Node([chain, leaf])
    root = Node([chain, tied])

    class Loss:
        grad_fn = root
    assert used_more_than_once(Loss()) == {tied}


def test_used_more_than_once_holds_the_nodes_it_visited():
    """A node two paths reach (a diamond) whose Python object lives only while referenced, as
    autograd's does: not held, it is made anew on the second path with another id, walked
    again, and its leaf counted twice. Held, it is seen once: only the tied leaf is found."""
    import weakref

    class Leaf:
        pass

    class Accumulate:
        def __init__(self, leaf):
            self.variable = leaf

    class Core:  # the C++ node; its Python object made on access, kept only while referenced
        def __init__(self, children):
            self.children, self._object = children, None

        def object(self):
            node = self._object() if self._object is not None else None
            if node is None:
                node = Node(self)
                self._object = weakref.ref(node)
            return node

    class Node:
        def __init__(self, core):
            self.core = core

        @property
        def next_functions(self):
            return tuple((Accumulate(c) if isinstance(c, Leaf) else c.object(), 0) for c in self.core.children)

    leaves = [Leaf() for _ in range(60)]
    tied, shared = leaves[0], Core([leaves[1]])  # shared: reached twice, its leaf used once
    chain = Core([tied, shared])
    for leaf in leaves[2:]:
        chain = Core([chain, leaf, shared] if leaf is leaves[30] else [chain, leaf])

    class Loss:
        grad_fn = Core([chain, tied]).object()
    assert used_more_than_once(Loss()) == {tied}
