"""Figures from every rank, gathered now and then, never every step: the phase timers' min and
max over the ranks at each log interval, the job's energy, and stragglers every
``train.straggler_every`` steps.

Each rank adds up its own steps as the trainer reads them (training/timers.py: no waiting). At a
log interval, or a straggler check, every rank sends one small vector (its phase sums, energy,
work, pipeline stage) in one all-gather over a gloo group: host numbers, so the gather waits for
the other ranks' hosts, which stand at the same step, and never for a GPU.

**Stragglers.** Ranks run in lockstep (each step ends in collectives), so a slow rank shows in
everybody's step time; what differs is where the time goes: the slow rank works, the others wait
for it (dp_wait, pipeline_wait). So each rank's *work* (its phases but the waits) per step over
the last ``straggler_every`` steps is compared with the median of the ranks holding the same
pipeline stage (a stage's ranks do the same work; the last stage, with the output layer, more
than the others); a rank more than ``train.straggler_margin`` over it is named, in a line and in
the metrics (``straggler_ranks``, ``stragglers``). Stages with a single rank have nothing to be
compared with. A rank's tensor-parallel peers wait for it inside its layers' collectives, which
are work too: a slow GPU makes its whole tp group look slow, and is named with it.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from tessera.training.energy import EnergyMeter
from tessera.training.timers import PHASES, work_seconds

LABELS = {"data": "data", "forward_backward": "forward-backward", "pipeline_wait": "pipeline wait",
          "dp_wait": "dp wait", "optimizer": "optimizer"}


def find_stragglers(work: list[float], stages: list[int], margin: float) -> list[int]:
    """The ranks whose ``work`` exceeds the median of the ranks of their pipeline stage by more
    than ``margin`` (0.2: 20 %); ``stages[r]`` is rank r's stage."""
    slow = []
    for stage in sorted(set(stages)):
        ranks = [r for r, s in enumerate(stages) if s == stage]
        if len(ranks) < 2:
            continue
        median = statistics.median(work[r] for r in ranks)
        slow += [r for r in ranks if work[r] > median * (1 + margin)]
    return sorted(slow)


class Monitor:
    """One rank's sums between gathers. ``step_done`` after each step is read; every rank calls
    it for the same steps (it gathers where due)."""

    def __init__(self, *, rank: int, world: int, pp: int, pp_rank: int, log_every: int, steps: int,
                 straggler_every: int, straggler_margin: float, energy: EnergyMeter | None = None,
                 group=None):
        self.rank, self.world, self.pp_rank, self.group = rank, world, pp_rank, group
        self.lines: list[str] = []  # what to print after the step's line (:meth:`take_lines`)
        self.log_every, self.steps = log_every, steps
        self.straggler_every, self.margin = straggler_every, straggler_margin
        self.phases = [p for p in PHASES if p != "pipeline_wait" or pp > 1]
        self.energy = energy
        self._energy_mark = energy.joules() if energy is not None else None
        self._reset_interval()
        self._window_work, self._window_steps, self._window_first = 0.0, 0, None

    def _reset_interval(self) -> None:
        self._sums = dict.fromkeys(self.phases, 0.0)
        self._steps, self._tokens = 0, 0

    def step_done(self, done: int, phases: dict[str, float], processed: int, gather: bool = True) -> dict:
        """Add step ``done``'s (counting from 1) phase seconds and processed tokens; at a log
        interval or a straggler check (``gather``: every rank is at this point), the metrics."""
        for name, seconds in phases.items():
            if name in self._sums:
                self._sums[name] += seconds
        self._steps += 1
        self._tokens += processed
        self._window_work += work_seconds(phases)
        self._window_steps += 1
        if self._window_first is None:
            self._window_first = done
        timers = done % self.log_every == 0 or done == self.steps
        stragglers = self.straggler_every > 0 and done % self.straggler_every == 0 and self._window_steps > 0
        if not gather or not (timers or stragglers):
            return {}
        joules = math.nan
        if self.energy is not None:
            now = self.energy.joules()
            joules, self._energy_mark = now - self._energy_mark, now
        mine = [*(self._sums[p] / max(self._steps, 1) for p in self.phases), joules,
                self._window_work / max(self._window_steps, 1), float(self.pp_rank)]
        rows = self._gather(mine)
        metrics: dict = {}
        if timers:
            metrics.update(self._timer_metrics(rows))
            self._reset_interval()
        if stragglers:
            metrics.update(self._straggler_metrics(rows, done))
            self._window_work, self._window_steps, self._window_first = 0.0, 0, None
        return metrics

    def take_lines(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    def _gather(self, mine: list[float]) -> list[list[float]]:
        if self.world == 1:
            return [mine]
        local = torch.tensor(mine, dtype=torch.float64)
        rows = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(rows, local, group=self.group)
        return [row.tolist() for row in rows]

    def _timer_metrics(self, rows: list[list[float]]) -> dict:
        n = len(self.phases)
        metrics, parts = {}, []
        for i, phase in enumerate(self.phases):
            values = [row[i] for row in rows]
            metrics[f"{phase}_s_min"], metrics[f"{phase}_s_max"] = min(values), max(values)
            spread = f"{min(values):.3g}-{max(values):.3g}" if self.world > 1 else f"{values[0]:.3g}"
            parts.append(f"{LABELS[phase]} {spread}")
        joules = [row[n] for row in rows]
        if all(math.isfinite(j) for j in joules) and self._steps:
            metrics["energy_j_per_step"] = sum(joules) / self._steps
            metrics["energy_j_per_token"] = sum(joules) / max(self._tokens, 1)
            parts.append(f"energy {metrics['energy_j_per_step']:,.0f} J/step, {metrics['energy_j_per_token']:.3g} J/token")
        ranks = f", min-max over {self.world} ranks" if self.world > 1 else ""
        self.lines.append(f"timers (s per step over the last {self._steps}{ranks}): " + " | ".join(parts))
        return metrics

    def _straggler_metrics(self, rows: list[list[float]], done: int) -> dict:
        n = len(self.phases)
        work, stages = [row[n + 1] for row in rows], [int(row[n + 2]) for row in rows]
        slow = find_stragglers(work, stages, self.margin)
        for rank in slow:
            median = statistics.median(w for w, s in zip(work, stages) if s == stages[rank])
            over = f"{100 * (work[rank] / median - 1):.0f} % over" if median > 0 else "over"
            self.lines.append(f"tessera: straggler over steps {self._window_first}-{done}: rank {rank} works "
                     f"{work[rank]:.3g} s per step, {over} the median {median:.3g} s of its pipeline stage's "
                     f"ranks (train.straggler_margin={self.margin:g})")
        return {"stragglers": len(slow), "straggler_ranks": slow}


__all__ = ["Monitor", "find_stragglers"]
