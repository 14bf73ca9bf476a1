"""Python's garbage collection at the same steps on every rank (``train.gc_interval``).

Python's automatic collector runs whenever enough objects were allocated, at a different moment
on each rank; a full collection can hold a rank's host for tens of milliseconds, long enough for
its GPU to run dry while the other ranks wait for it at the next collective (the jitter that
Megatron's ``--manual-gc`` and torchtitan's ``gc_freq`` address). With an interval, automatic
collection is off during training and a full collection runs every ``interval`` steps, the same
step everywhere (as Megatron's; torchtitan collects only the young generations, which leaves
cycles that reach the oldest one, and any GPU memory they hold, until the end), and once before
and after the loop.

The objects alive when the loop starts (torch's and the model's: modules, parameters, captured
graphs) are frozen after the first collection (``gc.freeze``: moved out of the collector's
sight) and unfrozen after the loop, so the periodic collections scan what training allocated,
not the whole heap: with everything scanned, each full collection held the host ~225 ms (GPT-1.3B
at dp=2 on 2x H100, steps of ~298 ms going to ~520-538 ms every 10th step, session 16); frozen,
each still cost ~0.3 s of step time (gc_interval=5, 2x H200, session 17), while on a CPU a frozen
collection takes ~0.1 ms against ~130 ms unfrozen (8-layer GPT, 12 steps): the GPU run's cost is
not the collector's scan. Each collection's host time is logged (``gc_ms``, on the step after
which it ran) to tell: on the GPU machine each held the host ~250 ms (269 and 245 ms, GPT-1.3B
dp=2, session 18), so what the first steps make after the start's freeze (compiled code, CUDA
graph state, caches) is the heap those collections scan. So the first periodic collection also
freezes what survives it, and the later ones scan only what training made since; measured
on the GPU machine it did not help (271.5 and 281.9 ms, session 19), so the cost is not the
scan (benchmarks/gc_probe.py tells a collection waiting for the GPU from the host's own work).
The interval stays opt-in.
"""

from __future__ import annotations

import gc
import time


class GarbageCollection:
    """``with GarbageCollection(interval) as collector:`` around the loop, ``collector.step(k)``
    after step k. interval 0: Python's automatic collection, untouched."""

    def __init__(self, interval: int):
        if interval < 0:
            raise ValueError(f"a garbage-collection interval is a number of steps >= 0, not {interval}")
        self.interval, self._was_enabled, self._froze, self._refrozen = interval, True, False, False

    def __enter__(self) -> GarbageCollection:
        if self.interval:
            self._was_enabled = gc.isenabled()
            gc.collect()
            self._froze = gc.get_freeze_count() == 0  # (someone else's freeze is theirs to undo)
            if self._froze:
                gc.freeze()
            gc.disable()
        return self

    def step(self, step: int) -> float | None:
        """After step ``step`` (0-based): the collection's host time in ms where one ran, else None."""
        if self.interval and (step + 1) % self.interval == 0:
            start = time.perf_counter()
            gc.collect()
            if self._froze and not self._refrozen:  # the first steps' survivors, out of sight too
                gc.freeze()
                self._refrozen = True
            return (time.perf_counter() - start) * 1e3
        return None

    def __exit__(self, *exc) -> None:
        if self.interval:
            if self._froze:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            gc.collect()
