"""A micro-batch pair's second backward adding its gradients on its own stream
(training/concurrent.py, ``DataParallel.side_adds``).

The two backwards of a pair run at once, the first on the step's stream, the second on a side
stream. Autograd runs every parameter's AccumulateGrad node, and so DataParallel's hook, on the
step's stream, so by default both micro-batches' fp32 gradient adds run there: ~30 ms of a
345 ms GPT-1.3B tp=2 step, which made the step's stream end each pair ~13 ms after the side
stream (session 18's profile). With ``SideAdds`` the second backward's gradients are added on
the side stream, where they were made. Two adds into one main gradient must not overlap: where
the second backward's add of a parameter is issued before the first's, it runs on the side
stream and the first's waits for it (for the event recorded after the side stream's latest add:
the side stream runs in order, so the latest covers every earlier one); where it is issued
after, it runs on the step's stream, after the first's. During the backwards the side stream
never waits for the step's: each stream's collectives wait for the other rank, and waits in
both directions, taken in a different order on each rank (the order hooks run in follows each
host's timing), can close a cycle across the ranks. The step's stream waiting for the side
stream is what autograd itself does, in the same direction on every rank. (The side stream
waits for the step's only at a pair's start, and after each piece of the step's first forward
where zero 1/2's gather waits there: in program order, the same on every rank.) (The first version waited both
ways; its GPU test, fp32 pairs against the plain run, ran out of its time twice, session 18;
session 19 found the pairs hang now and then without side adds too: training/concurrent.py.)
Every hook runs on autograd's one CUDA thread, so "issued before" is the order they run in, and
each event is recorded before anything waits for it. A reduction reads the buffers on the step's
stream, which first waits for the side stream's adds so far.

A parameter the graph uses more than once (a tied embedding: the lookup and the output layer)
gets its gradients summed by autograd on its AccumulateGrad node's stream, the step's, so its
second add runs there too (``step_only``, found once by ``used_more_than_once``): on the side
stream it would read the sum before the step's stream had made it.

Which gradients are the second backward's: those whose hook runs inside its autograd graph task,
whose id the task's first node reports (``started``, set by ``MarkStart`` at the root of the
second loss)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn


class SideAdds:
    """One pair's ordering state. ``event`` and ``on_stream``: torch.cuda.Event and
    torch.cuda.stream (tests pass stand-ins)."""

    def __init__(self, step, side, event=None, on_stream=None, step_only: set[nn.Parameter] = frozenset()):
        event = event or torch.cuda.Event
        self.step, self.side, self.step_only = step, side, step_only
        self.task: int | None = None  # the second backward's graph task, once it has started
        self._side_done = event()
        self._on_stream = on_stream or torch.cuda.stream
        self._recorded = self._waited = 0  # side adds recorded; of those, how many the step waited for
        self._on_side: set[nn.Parameter] = set()
        self._on_step: set[nn.Parameter] = set()

    def started(self, task: int) -> None:
        self.task = task

    def is_side(self) -> bool:
        """Whether the hook running now belongs to the second backward."""
        return self.task is not None and torch._C._current_graph_task_id() == self.task

    @contextlib.contextmanager
    def second_add(self, p: nn.Parameter):
        """Around the second backward's add of ``p``: on the side stream, recorded after for
        what comes later; or, where the first's add of ``p`` was issued before, on the step's
        stream (the hook's), after it."""
        if p in self._on_step or p in self.step_only:
            yield
            return
        with self._on_stream(self.side):
            yield
        self._side_done.record(self.side)
        self._recorded += 1
        self._on_side.add(p)

    def before_step_add(self, p: nn.Parameter) -> None:
        """Before the first backward's add of ``p`` on the step's stream."""
        if p in self._on_side:
            self.step_waits()
        self._on_step.add(p)

    def step_waits(self) -> None:
        """The step's stream waits for every side add so far (before a reduction reads them)."""
        if self._waited < self._recorded:
            self.step.wait_event(self._side_done)
            self._waited = self._recorded


class MarkStart(torch.autograd.Function):
    """Identity on a loss; its backward, the first node of that loss's backward, tells
    ``adds`` its graph task."""

    @staticmethod
    def forward(ctx, loss: Tensor, adds: SideAdds) -> Tensor:
        ctx.adds = adds
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.adds.started(torch._C._current_graph_task_id())
        return grad, None


def used_more_than_once(loss: Tensor) -> set[nn.Parameter]:
    """The leaf tensors that ``loss``'s autograd graph reaches by more than one edge (autograd
    sums their gradients before their AccumulateGrad node). Counted per leaf, and every node
    visited is held until the end: a node's Python object can die once the walk moves on, and a
    new one could then take its id (an id-keyed count missed the tied embedding on the GPU,
    session 19)."""
    edges: dict[int, int] = {}
    leaves: dict[int, Tensor] = {}
    seen: dict[int, object] = {}  # id -> node, held
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for child, _ in node.next_functions:
            if child is None:
                continue
            if hasattr(child, "variable"):  # an AccumulateGrad node
                leaf = child.variable
                edges[id(leaf)] = edges.get(id(leaf), 0) + 1
                leaves[id(leaf)] = leaf
            else:
                stack.append(child)
    return {leaves[k] for k, n in edges.items() if n > 1}
