"""Run the per-rank action lists on a clock: step time, bubble fraction, and deadlock detection.

Each rank executes its compute actions in list order; an action starts when the rank is free
and its input is ready (the producer's finish time plus ``comm`` latency). Sends never block
(they are asynchronous), so the only waits are the ones a real run has. If no rank can make
progress before all are done, the lists would hang a real run: :class:`ScheduleError` says where.

Bubble fraction = (step time - busy time) / busy time, for the busiest rank; with uniform costs
it is (p - 1) / m for 1F1B, (p - 1) / (v * m) for interleaved and (p - 1) / (3 m) for ZB-H1
(with F = I = W), the analytic values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.pipeline_parallel.schedules import COMPUTE, SPLIT_BACKWARD, Action, Op, ScheduleError


@dataclass
class Costs:
    """Time of each compute action of one model chunk (a virtual stage)."""

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741
    W: float = 1.0
    comm: float = 0.0
    # per pipeline rank, a factor on its compute times (heterogeneous stages: a stage of tp x dp
    # ranks runs a pipeline micro-batch in 1 / (tp * dp) of one rank's time); empty: all 1
    rank_scale: tuple[float, ...] = ()

    def __post_init__(self):
        for name in ("F", "B", "I", "W", "comm"):
            value = getattr(self, name)
            if not (0 <= value < math.inf and (value > 0 or name == "comm")):
                raise ValueError(f"Costs.{name} must be a finite time {'>= 0' if name == 'comm' else '> 0'}, "
                                 f"not {value}")
        if not all(0 < x < math.inf for x in self.rank_scale):
            raise ValueError(f"Costs.rank_scale must hold finite factors > 0, not {list(self.rank_scale)}")

    def of(self, op: Op, rank: int = 0) -> float:
        return getattr(self, op.value) * (self.rank_scale[rank] if self.rank_scale else 1.0)

    @staticmethod
    def stage_scale(stage_tp: list[int], stage_dp: list[int]) -> tuple[float, ...]:
        """``rank_scale`` of heterogeneous stages: a pipeline micro-batch's work split ideally over
        each stage's tp x dp ranks, relative to the smallest stage grid."""
        smallest = min(t * d for t, d in zip(stage_tp, stage_dp))
        return tuple(smallest / (t * d) for t, d in zip(stage_tp, stage_dp))


@dataclass
class Timeline:
    """Start and end of every compute action: ``spans[rank] = [(action, start, end), ...]``."""

    spans: list[list[tuple[Action, float, float]]] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return max((end for rank in self.spans for _, _, end in rank), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.spans[rank])

    @property
    def bubble_fraction(self) -> float:
        busy = max(self.busy(r) for r in range(len(self.spans)))
        return (self.step_time - busy) / busy if busy else 0.0

    def peak_in_flight(self, rank: int) -> int:
        """Most micro-batches whose activations this rank holds at once (F done, B or I not)."""
        return self._peak(rank, Op.F, (Op.B, Op.I))

    def peak_weight_grads_pending(self, rank: int) -> int:
        """Most micro-batches whose W this rank has deferred at once (I done, W not): each keeps
        only its linear layers' inputs and output gradients."""
        return self._peak(rank, Op.I, (Op.W,))

    def peak_held(self, rank: int) -> int:
        """Most micro-batches this rank holds anything of at once (F done, B or W not)."""
        return self._peak(rank, Op.F, (Op.B, Op.W))

    def _peak(self, rank: int, opens: Op, closes: tuple[Op, ...]) -> int:
        held, peak = set(), 0
        for action, _, _ in self.spans[rank]:
            key = (action.microbatch, action.chunk)
            if action.op == opens:
                held.add(key)
                peak = max(peak, len(held))
            elif action.op in closes:
                held.discard(key)
        return peak


def _producer(action: Action, rank: int, pp: int, vpp: int, uses_split: list[bool]) -> tuple | None:
    """(op, microbatch, chunk, rank) whose end this compute action waits for, if any."""
    stage, last = action.chunk * pp + rank, pp * vpp - 1
    mb = action.microbatch
    if action.op == Op.F:
        if stage == 0:
            return None
        prev = stage - 1
        return (Op.F, mb, prev // pp, prev % pp)
    if action.op in (Op.B, Op.I):
        if stage == last:
            return (Op.F, mb, action.chunk, rank)
        nxt = stage + 1
        return (Op.I if uses_split[nxt % pp] else Op.B, mb, nxt // pp, nxt % pp)
    return (Op.I, mb, action.chunk, rank)  # W waits for its own I


def simulate(schedules: list[list[Action]], vpp: int | None = None, costs: Costs | None = None) -> Timeline:
    """``vpp`` defaults to the number of chunks the actions use."""
    costs = costs or Costs()
    pp = len(schedules)
    if costs.rank_scale and len(costs.rank_scale) != pp:
        raise ValueError(f"Costs.rank_scale has {len(costs.rank_scale)} factors for {pp} pipeline ranks")
    orders = [[a for a in actions if a.op in COMPUTE] for actions in schedules]
    vpp = vpp or 1 + max((a.chunk for order in orders for a in order), default=0)
    uses_split = [any(a.op == Op.I for a in order) for order in orders]
    ends: dict[tuple, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    timeline = Timeline(spans=[[] for _ in range(pp)])
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                action = orders[r][pos[r]]
                dep = _producer(action, r, pp, vpp, uses_split)
                ready = 0.0
                if dep is not None:
                    if dep not in ends:
                        break
                    local = dep[3] == r
                    ready = ends[dep] + (0.0 if local else costs.comm)
                start = max(free[r], ready)
                end = start + costs.of(action.op, r)
                ends[(action.op, action.microbatch, action.chunk, r)] = end
                timeline.spans[r].append((action, start, end))
                free[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(pp) if pos[r] < len(orders[r])}
            raise ScheduleError(f"the schedule would hang: ranks wait forever at {stuck}")
    return timeline


def analytic_bubble(kind: str, pp: int, vpp: int, microbatches: int) -> float | None:
    """The textbook bubble fraction with costs F = I = W (B = I + W), for whole rounds (m % pp == 0);
    None for interleaved-zb, which has none (its deferral is chosen for the measured costs)."""
    if kind in ("1f1b", "gpipe"):
        return (pp - 1) / microbatches
    if kind == "interleaved":
        return (pp - 1) / (vpp * microbatches)
    if kind == "interleaved-zb":
        return None
    if kind in SPLIT_BACKWARD:  # (p - 1)(F + I - W) / (m (F + I + W)) with F = I = W: a third of 1F1B's
        return (pp - 1) / (3 * microbatches)
    return 0.0  # none


__all__ = ["Costs", "Timeline", "simulate", "analytic_bubble"]
