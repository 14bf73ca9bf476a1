"""Heterogeneous pipelines: each stage on a rank grid of its own size (``parallel.stage_tp`` /
``stage_dp``), as Megatron's bridge communicator allows (e.g. a wide first stage for a large
embedding, then narrower stages).

Stage ``s`` owns a contiguous block of ``stage_tp[s] * stage_dp[s]`` ranks, laid out tp fastest
then dp inside the block (cp is 1)::

    global_rank = offset[s] + tp_rank + stage_tp[s] * dp_rank,   offset[s] = sum of earlier blocks

A rank's :class:`StageTopology` is a :class:`~tessera.topology.Topology` whose ``tp`` and ``dp``
are its own stage's, with groups inside the stage's block, so the model, TP layers and data
parallelism run unchanged. Stages exchange activations through the bridge
(pipeline_parallel/bridge.py), not over a ``pp`` group, which a heterogeneous layout has none of.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from tessera.topology import Coordinates, Topology


@dataclass(frozen=True)
class StageGrid:
    """The sizes of every stage's grid and the rank formula over them (no process groups)."""

    stage_tp: tuple[int, ...]
    stage_dp: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.stage_tp) != len(self.stage_dp) or not self.stage_tp or min(self.stage_tp + self.stage_dp) < 1:
            raise ValueError(f"stage_tp {list(self.stage_tp)} and stage_dp {list(self.stage_dp)} need one size >= 1 "
                             "per stage each")

    @property
    def pp(self) -> int:
        return len(self.stage_tp)

    def size(self, stage: int) -> int:
        return self.stage_tp[stage] * self.stage_dp[stage]

    def offset(self, stage: int) -> int:
        return sum(self.size(s) for s in range(stage))

    @property
    def world_size(self) -> int:
        return self.offset(self.pp)

    def rank_of(self, stage: int, tp_rank: int, dp_rank: int) -> int:
        return self.offset(stage) + tp_rank + self.stage_tp[stage] * dp_rank

    def coordinates_of(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of the stages")
        stage = next(s for s in range(self.pp) if rank < self.offset(s + 1))
        local, tp = rank - self.offset(stage), self.stage_tp[stage]
        return Coordinates(tp=local % tp, cp=0, dp=local // tp, pp=stage)

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(self.offset(stage), self.offset(stage + 1)))

    def tp_groups(self, stage: int) -> list[list[int]]:
        return [[self.rank_of(stage, t, d) for t in range(self.stage_tp[stage])] for d in range(self.stage_dp[stage])]

    def dp_groups(self, stage: int) -> list[list[int]]:
        return [[self.rank_of(stage, t, d) for d in range(self.stage_dp[stage])] for t in range(self.stage_tp[stage])]

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage's ranks at equal (tp, dp) coordinates (their grids must match:
        a tied embedding's two copies are summed shard by shard)."""
        last = self.pp - 1
        if (self.stage_tp[0], self.stage_dp[0]) != (self.stage_tp[last], self.stage_dp[last]):
            return []
        return [[self.rank_of(0, t, d), self.rank_of(last, t, d)] for d in range(self.stage_dp[0])
                for t in range(self.stage_tp[0])]


@dataclass(eq=False)
class StageTopology(Topology):
    """This rank's stage grid as a :class:`Topology` (``tp``, ``dp``: its stage's sizes; ``pp``: the
    number of stages). Groups: ``tp``, ``dp`` (= ``dp_cp``), ``dp_scalars`` inside the stage,
    ``embedding`` (first and last stage, equal grids only) and ``mp``: every rank, over which the
    gradient norm is summed (each stage counts its parameters once: clip.py)."""

    grid: StageGrid | None = None
    heterogeneous = True

    @classmethod
    def build_stages(cls, stage_tp: list[int], stage_dp: list[int], device: torch.device | str = "cpu",
                     timeout: datetime.timedelta | None = None) -> "StageTopology":
        """Make every stage's groups over the default process group (every rank calls it)."""
        grid = StageGrid(tuple(stage_tp), tuple(stage_dp))
        world = dist.get_world_size()
        if grid.world_size != world:
            raise ValueError(f"stage_tp {stage_tp} x stage_dp {stage_dp} make {grid.world_size} ranks, not the "
                             f"world size {world}")
        rank = dist.get_rank()
        here = grid.coordinates_of(rank)
        stage = here.pp
        topo = cls(tp=stage_tp[stage], cp=1, dp=stage_dp[stage], pp=grid.pp, rank=rank, device=torch.device(device),
                   timeout=timeout, grid=grid)
        # every rank creates every group, in one order
        mine: dict[str, dist.ProcessGroup | None] = {}
        for s in range(grid.pp):
            for name, members in (("tp", grid.tp_groups(s)), ("dp", grid.dp_groups(s)),
                                  ("dp_scalars", grid.dp_groups(s))):
                group = topo.new_groups(members)
                if s == stage:
                    mine[name] = group
        tp_group, dp_group, scalars = mine["tp"], mine["dp"], mine["dp_scalars"]
        embedding = topo.new_groups(grid.embedding_groups()) if grid.embedding_groups() else None
        everyone = topo.new_groups([list(range(world))])
        topo.groups.update(tp=tp_group if topo.tp > 1 else None, cp=None, pp=None,
                           dp=dp_group if topo.dp > 1 else None, dp_cp=dp_group if topo.dp > 1 else None,
                           dp_scalars=scalars if topo.dp > 1 else None, embedding=embedding,
                           mp=everyone if world > 1 else None)
        return topo

    @cached_property
    def coords(self) -> Coordinates:
        return self.grid.coordinates_of(self.rank)

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    def ranks_of(self, axis: str) -> list[int]:
        c, g = self.coords, self.grid
        if axis == "tp":
            return [g.rank_of(c.pp, t, c.dp) for t in range(self.tp)]
        if axis in ("dp", "dp_cp"):
            return [g.rank_of(c.pp, c.tp, d) for d in range(self.dp)]
        if axis == "embedding":
            return next((r for r in g.embedding_groups() if self.rank in r), [self.rank])
        if axis == "mp":
            return list(range(self.world_size))
        if axis == "cp":
            return [self.rank]
        raise ValueError(f"a heterogeneous layout has no {axis} axis: its stages meet through the bridge")

    def all_ranks_along(self, axis: str) -> list[list[int]]:
        raise ValueError(f"a heterogeneous layout has no mesh to enumerate {axis} groups over")

    def __repr__(self) -> str:
        c = self.coords
        return (f"StageTopology(stage_tp={list(self.grid.stage_tp)}, stage_dp={list(self.grid.stage_dp)}; rank "
                f"{self.rank} in stage {c.pp} at tp={c.tp}/{self.tp} dp={c.dp}/{self.dp})")
