"""Python's garbage collection at the same steps on every rank (``train.gc_interval``).

Python's automatic collector runs whenever enough objects were allocated, at a different moment
on each rank; a full collection can hold a rank's host for tens of milliseconds, long enough for
its GPU to run dry while the other ranks wait for it at the next collective (the jitter that
Megatron's ``--manual-gc`` and torchtitan's ``gc_freq`` address). With an interval, automatic
collection is off during training and a full collection runs every ``interval`` steps, the same
step everywhere (as Megatron's; torchtitan collects only the young generations, which leaves
cycles that reach the oldest one, and any GPU memory they hold, until the end), and once before
and after the loop.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """``with GarbageCollection(interval) as collector:`` around the loop, ``collector.step(k)``
    after step k. interval 0: Python's automatic collection, untouched."""

    def __init__(self, interval: int):
        if interval < 0:
            raise ValueError(f"a garbage-collection interval is a number of steps >= 0, not {interval}")
        self.interval, self._was_enabled = interval, True

    def __enter__(self) -> GarbageCollection:
        if self.interval:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
        return self

    def step(self, step: int) -> None:
        if self.interval and (step + 1) % self.interval == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.interval:
            if self._was_enabled:
                gc.enable()
            gc.collect()
