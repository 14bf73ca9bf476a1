"""Stopping a run cleanly when asked: a signal (SIGTERM, SIGUSR1) or a wall-clock limit
(``train.exit_after_minutes``), on any rank; every rank agrees on the step to stop after.

A job manager asks a job to stop by a signal: Slurm sends SIGTERM to every process of a job it
preempts or cancels (and SIGKILL a grace period later), or SIGUSR1 ahead of the time limit with
``--signal=USR1@SECONDS``; Kubernetes sends SIGTERM. A signal reaches the ranks at different
moments, and a clock runs differently on each machine, so a rank that alone stopped would leave
the others waiting in the next step's collectives. The ranks therefore *vote*:

1. the signal handler (:meth:`StopRequest.handler`) only records the signal; the Python code
   running when it arrives (a step's launch, a collective, a save) goes on;
2. each step's launch turns this rank's wish (0: go on, 1: the wall-clock limit, 2: a signal)
   into a one-element tensor on the device and starts an all-reduce (MAX) of it over the whole
   world, asynchronously, on the default group (:meth:`StopRequest.vote`); on CUDA its result is
   copied into pinned host memory on a side stream behind an event, so neither the compute stream
   nor the host waits for it;
3. the trainer reads a step's vote where it reads the step's figures anyway (after launching the
   next step: training/step.py), so the vote costs no host synchronization beyond the loop's own.
   Every rank reads the same number at the same step, so all stop after the same step: the one
   launched meanwhile (the step in hand), which they finish; then they save a checkpoint (a
   background save is waited for) and return, and the process exits 0.

A vote per step: one 4-byte all-reduce on its own stream, beside a step of many larger ones. A
stop asked before the loop starts (during the build or the resume) is agreed on by one blocking
vote before the first step, and the run stops without a step (nothing new to save).

Where a rank's request comes from after a launcher's restart, the clock counts from the job's
start (``TESSERA_JOB_START``, set by ``tessera train --nproc-per-node``), not the worker's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # (training/launcher.py passes these on to the workers)
GO_ON, TIME_LIMIT, SIGNALLED = 0, 1, 2
JOB_START = "TESSERA_JOB_START"  # epoch seconds at which the launcher started the job


def job_started(clock=time.monotonic) -> float:
    """When the job started, on ``clock``: the launcher's start where it says (a restarted worker
    counts from there), else now."""
    now = clock()
    with contextlib.suppress(KeyError, ValueError):
        return now - max(0.0, time.time() - float(os.environ[JOB_START]))
    return now


@dataclass
class Vote:
    """One step's vote, in flight: the all-reduced wish, read later (:meth:`read`)."""

    value: torch.Tensor  # on the host (pinned on CUDA) once ready
    work: object | None = None  # gloo: the all-reduce to wait for
    ready: torch.cuda.Event | None = None  # CUDA: recorded behind the copy to the host
    _read: int | None = None

    def read(self) -> int:
        if self._read is None:
            if self.work is not None:
                self.work.wait()
            if self.ready is not None:
                self.ready.synchronize()
            self._read = int(self.value.item())
        return self._read


class StopRequest:
    """This process's wish to stop, and the world's agreement on it.

    ``limit_s``: stop once the job has run this long (0: no limit), on ``clock`` from ``started``.
    ``install()`` puts :meth:`handler` on SIGTERM and SIGUSR1 (restoring the previous handlers
    after); tests call :meth:`ask` directly or send the signal."""

    def __init__(self, limit_s: float = 0.0, clock=time.monotonic, started: float | None = None):
        self.limit_s, self.clock = limit_s, clock
        self.started = clock() if started is None else started
        self.signal: int | None = None  # the first stop signal this process received
        self.agreed = GO_ON  # what the world agreed on, once a vote says stop
        self._stream = None

    # -- this rank's wish ---------------------------------------------------------------------
    def handler(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def ask(self, signum: int = signal.SIGTERM) -> None:
        """As if ``signum`` had arrived (tests)."""
        self.handler(signum, None)

    @contextlib.contextmanager
    def install(self):
        """The handlers on SIGTERM and SIGUSR1 for the block (main thread only: Python's rule)."""
        previous = {sig: signal.signal(sig, self.handler) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def wish(self) -> int:
        if self.signal is not None:
            return SIGNALLED
        if self.limit_s and self.clock() - self.started >= self.limit_s:
            return TIME_LIMIT
        return GO_ON

    # -- the world's agreement ----------------------------------------------------------------
    def vote(self, device: torch.device) -> Vote:
        """Start the all-reduce of this rank's wish (every rank calls it at the same point)."""
        wish = self.wish()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return Vote(torch.tensor(wish), _read=wish)
        flag = torch.full((1,), wish, dtype=torch.int32, device=device)  # (a fill kernel: no copy, no wait)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if device.type != "cuda":
            return Vote(flag, work)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        host = torch.empty((1,), dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(self._stream):  # (the compute stream never waits for the vote)
            work.wait()
            host.copy_(flag, non_blocking=True)
            flag.record_stream(self._stream)
            ready = torch.cuda.Event()
            ready.record()
        return Vote(host, None, ready)

    def read(self, vote: Vote | None) -> int:
        """A step's vote read (it waits for that step's work only); the agreement so far."""
        if vote is not None:
            self.agreed = max(self.agreed, vote.read())
        return self.agreed

    def agree_now(self, device: torch.device) -> int:
        """One vote, waited for at once (before the loop: a stop asked during the build)."""
        return self.read(self.vote(device))

    def reason(self) -> str:
        """What stopped the run, in words (the world's agreement; this rank's signal if it had one)."""
        if self.agreed == SIGNALLED:
            return signal.Signals(self.signal).name if self.signal is not None else "a stop signal to another rank"
        minutes = f"{self.limit_s / 60:g}"
        return f"train.exit_after_minutes={minutes} reached"


__all__ = ["StopRequest", "Vote", "STOP_SIGNALS", "JOB_START", "job_started"]
