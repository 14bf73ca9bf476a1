"""Where a step's time goes: one timer per phase, read after the step, never waited for.

The phases of a step, in order (a step's time is the sum of these and the host's gaps between
steps, which on a GPU run ahead of the device and cost nothing):

    data              the step's micro-batches read, broadcast over tp, copied to the device
    forward_backward  the schedule's forward and backward compute (the executor), its pipeline waits left out
    pipeline_wait     waits for a pipeline neighbour's activation or gradient (pp > 1)
    dp_wait           the data-parallel reductions: the step's token count, then the gradient buckets
                      still in flight after backward (a fast rank waits here for a slow one)
    optimizer         tp/embedding gradient sums, the gradient norm, the AdamW step

A span nested in another (a pipeline wait inside forward_backward) counts for itself only: the
outer one's time leaves it out, so the phases add up to the time they cover together.

On CUDA a span's ends are events recorded on the current stream: they measure the device's
time (the host runs a step ahead; its clock would time the launches), and are read only after
the trainer has waited for the step's figures, when the events are complete, so reading them
never stops the host. Elsewhere the ends are the host clock (``clock``; tests give a stand-in),
where the work runs as it is launched.
"""

from __future__ import annotations

import contextlib
import time

import torch

PHASES = ("data", "forward_backward", "pipeline_wait", "dp_wait", "optimizer")
WAITS = ("pipeline_wait", "dp_wait")  # time spent waiting for other ranks


class PhaseTimer:
    """Spans of one rank's steps: ``with timer.span("optimizer"): ...``; :meth:`take` hands a
    step's spans over, to be read once its work is done."""

    def __init__(self, device: torch.device, clock=time.perf_counter):
        self.cuda, self.clock = device.type == "cuda", clock
        self._spans: list[list] = []  # [name, start, end, parent index or None]
        self._open: list[int] = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    @contextlib.contextmanager
    def span(self, name: str):
        index = len(self._spans)
        self._spans.append([name, self._mark(), None, self._open[-1] if self._open else None])
        self._open.append(index)
        try:
            yield
        finally:
            self._open.pop()
            self._spans[index][2] = self._mark()

    def take(self) -> StepPhases:
        """The spans recorded since the last take (one step's)."""
        spans, self._spans, self._open = self._spans, [], []
        return StepPhases(spans, self.cuda)


class StepPhases:
    """One step's spans; :meth:`seconds` reads them (on CUDA, once the step's work is done)."""

    def __init__(self, spans: list[list], cuda: bool):
        self._spans, self._cuda = spans, cuda

    @property
    def names(self) -> list[tuple[str, str | None]]:
        """Each span's name and its parent's (None at the top), in the order they opened."""
        return [(name, self._spans[parent][0] if parent is not None else None) for name, _, _, parent in self._spans]

    def _duration(self, start, end) -> float:
        if end is None:  # (a span the step's failure left open)
            return 0.0
        return start.elapsed_time(end) / 1e3 if self._cuda else end - start

    def seconds(self) -> dict[str, float]:
        """Seconds per phase, each span's own time (nested spans left out of their parent's)."""
        whole = [self._duration(start, end) for _, start, end, _ in self._spans]
        own = list(whole)
        for i, (_, _, _, parent) in enumerate(self._spans):
            if parent is not None:
                own[parent] -= whole[i]
        totals: dict[str, float] = {}
        for (name, *_), seconds in zip(self._spans, own):
            totals[name] = totals.get(name, 0.0) + seconds
        return totals


def work_seconds(phases: dict[str, float]) -> float:
    """A rank's own work in a step: its phases but the waits for other ranks (what a straggler
    has more of; the waits are where the others wait for it)."""
    return sum(seconds for name, seconds in phases.items() if name not in WAITS)


__all__ = ["PhaseTimer", "StepPhases", "PHASES", "WAITS", "work_seconds"]
