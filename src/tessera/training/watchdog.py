"""A training step that hangs ends the job with every thread's stack, not never (``train.timeout_s``).

NCCL's watchdog ends a job whose eager collective waits longer than the collective timeout, but
not every hang is one: collectives captured in CUDA graphs are not tracked, and a host blocked in
a graph replay, a device synchronization or a Python lock waits forever. So the training loop
arms a timer at each step's start: a step that takes longer than its limit dumps every thread's
Python stack to stderr and ends the process with exit code 1 (torchrun then ends the others),
which says where each rank stood.

The limit is ``train.timeout_s`` or five times the slowest step so far, whichever is longer (a
healthy run whose steps are long is not cut short); the first step, which compiles layers and
warms up, is not timed, nor is anything after the loop. The timer is the standard library's
``faulthandler.dump_traceback_later``: a C thread that needs neither the GIL nor a responsive
main thread, but one per process, so training owns it while the loop runs (a timer set before is
replaced) and cancels it after. Work added to the loop that may rightly take long (a
checkpoint's save, an evaluation) runs under ``watchdog.paused()``: not timed, and not counted into
its step's time (which would raise every later step's limit).
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import time


class StepWatchdog:
    """``with StepWatchdog(timeout_s) as watchdog:`` around the loop, ``watchdog.tick()`` at each
    step's start and once before the loop's tail (reading the last step's figures, which waits
    for its GPU work). ``arm(seconds)`` / ``disarm()``: the timer (tests pass stand-ins)."""

    SLOWEST_FACTOR = 5.0

    def __init__(self, timeout_s: float, arm=None, disarm=None, clock=time.monotonic):
        if not 0 < timeout_s <= 1e9:  # (NaN too; faulthandler takes no more)
            raise ValueError(f"a step timeout is a number of seconds in (0, 1e9], not {timeout_s}")
        self.timeout_s = timeout_s
        self._arm = arm or (lambda seconds: faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr()))
        self._disarm = disarm or faulthandler.cancel_dump_traceback_later
        self._clock = clock
        self._started: float | None = None
        self._steps = 0
        self.slowest = 0.0  # the slowest timed step so far, seconds

    def __enter__(self) -> StepWatchdog:
        return self

    def tick(self) -> None:
        """A step (or the tail) starts: the one before it took until now; from the second step
        on, the timer is set to this one's limit."""
        now = self._clock()
        if self._started is not None and self._steps > 1:  # (the first step is not timed)
            self.slowest = max(self.slowest, now - self._started)
        self._started = now
        self._steps += 1
        if self._steps > 1:
            self._arm(self.limit())

    @contextlib.contextmanager
    def paused(self):
        """Run a block without the timer (a checkpoint's save: its time depends on the file
        system, not on the step); the step's timer starts again after it, its time not counted."""
        armed, began = self._steps > 1, self._clock()
        if armed:
            self._disarm()
        try:
            yield
        finally:
            if self._started is not None:
                self._started += self._clock() - began
            if armed:
                self._arm(self.limit())

    def limit(self) -> float:
        return max(self.timeout_s, self.SLOWEST_FACTOR * self.slowest)

    def __exit__(self, *exc) -> None:
        if self._steps > 1:
            self._disarm()


def _stderr():
    """Where the stacks go: stderr, or the process's own where it was replaced by an object with
    no file descriptor (faulthandler writes to one from its C thread)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
