"""Who is who: the rank grid and its process groups (Megatron's parallel_state, as an object).

Ranks are laid out with tp fastest, then cp, then dp, then pp, so a TP group is a run of
consecutive ranks (one node) and the pipeline is the slowest axis::

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

A :class:`Topology` is built once, checked once, and handed to everything that communicates.
Nothing is stored in module globals, so two topologies can live in one process (tests do this).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

AXES = ("pp", "dp", "cp", "tp")  # slowest to fastest


@dataclass(frozen=True)
class Coordinates:
    tp: int
    cp: int
    dp: int
    pp: int


def rank_of(coords: Coordinates, tp: int, cp: int, dp: int) -> int:
    return coords.tp + tp * (coords.cp + cp * (coords.dp + dp * coords.pp))


def coordinates_of(rank: int, tp: int, cp: int, dp: int) -> Coordinates:
    return Coordinates(tp=rank % tp, cp=rank // tp % cp, dp=rank // (tp * cp) % dp, pp=rank // (tp * cp * dp))


@dataclass(eq=False)
class Topology:
    """Sizes, this rank's coordinates and the process groups of one parallel layout.

    ``groups[axis]`` is this rank's group along ``axis`` (``tp``, ``cp``, ``dp``, ``pp``), plus
    ``mp`` (tp x pp: the ranks holding one copy of the model), ``embedding`` (the first and
    last pipeline stage, which both hold a tied embedding), ``dp_cp`` (dp x cp: the ranks whose
    gradients are summed, as the weights are replicated over cp; ``dp`` itself where cp=1) and
    ``dp_scalars`` (the dp x cp ranks again, on a communicator of their own, for the step's small
    reductions). A group is ``None`` when it would contain only this rank, and collectives over
    ``None`` are no-ops. ``dp_mesh`` is the dp x cp ranks as a one-dimensional mesh (FSDP2).
    """

    tp: int
    cp: int
    dp: int
    pp: int
    rank: int
    device: torch.device
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    timeout: datetime.timedelta | None = None
    heterogeneous = False  # (a class constant: StageTopology's stages have grids of their own)

    def new_groups(self, members: list[list[int]]) -> dist.ProcessGroup | None:
        """Create a group for each rank list (all ranks must call this alike); return ours."""
        mine = None
        for ranks in members:
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                mine = group
        return mine

    def all_ranks_along(self, axis: str) -> list[list[int]]:
        """Every group along a mesh axis, as global rank lists, in a fixed order."""
        groups = {}
        for rank in range(self.world_size):
            here = coordinates_of(rank, self.tp, self.cp, self.dp)
            key = tuple(v for k, v in here.__dict__.items() if k != axis)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, dp: int = 0, cp: int = 1, device: torch.device | str = "cpu",
              timeout: datetime.timedelta | None = None) -> "Topology":
        """Make the groups for this layout over the default process group (every rank calls it).

        ``timeout`` bounds every collective on these groups (default: torch's, 30 min on gloo).
        Without an initialised process group this gives the single-rank topology.
        """
        device = torch.device(device)
        if not dist.is_initialized():
            if tp * pp * cp * max(dp, 1) != 1:
                raise RuntimeError("a multi-rank topology needs torch.distributed to be initialised")
            return cls(tp=1, cp=1, dp=1, pp=1, rank=0, device=device)
        world = dist.get_world_size()
        if world % (tp * pp * cp):
            raise ValueError(f"tp*cp*pp = {tp}*{cp}*{pp} does not divide the world size {world}")
        dp = dp or world // (tp * pp * cp)
        if tp * cp * dp * pp != world:
            raise ValueError(f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} != world size {world}")
        topo = cls(tp=tp, cp=cp, dp=dp, pp=pp, rank=dist.get_rank(), device=device, timeout=timeout)
        # Every group is made here with the job's collective timeout (new_group's default is
        # torch's 30 minutes, not the world's), so a dead peer fails every collective in time.
        # new_group must be called by every rank for every group, in the same order.
        axis_groups = []
        for axis in AXES:
            mine = topo.new_groups(topo.all_ranks_along(axis))
            axis_groups.append(mine)
            topo.groups[axis] = mine if getattr(topo, axis) > 1 else None
        # The mesh over the same groups, for the libraries that want one (FSDP2, DCP).
        layout = torch.arange(world).reshape(pp, dp, cp, tp)
        topo.mesh = DeviceMesh.from_group(axis_groups, device.type, mesh=layout, mesh_dim_names=AXES)
        # tp x pp (one model replica) and the embedding group are not mesh axes.
        for name, members in (("mp", topo._mp_ranks()), ("embedding", topo._embedding_ranks())):
            group = topo.new_groups(members)
            topo.groups[name] = group if len(topo.ranks_of(name)) > 1 else None
        # Gradients are summed over dp x cp (the weights are replicated over cp).
        if cp == 1:
            topo.groups["dp_cp"], topo.dp_mesh = topo.groups["dp"], topo.mesh["dp"]
        else:
            group = topo.new_groups(topo._dp_cp_ranks())
            topo.groups["dp_cp"] = group if dp * cp > 1 else None
            topo.dp_mesh = DeviceMesh.from_group(group, device.type, mesh=topo.ranks_of("dp_cp"),
                                                 mesh_dim_names=("dp_cp",))
        # The step's small reductions over dp x cp (token count, loss) on their own communicator:
        # NCCL runs one communicator's work in order, so on "dp_cp" they would queue behind zero
        # 1/2's parameter all-gather, and the compute stream, waiting for them, would wait for
        # the whole gather the next forward is meant to overlap.
        topo.groups["dp_scalars"] = topo.new_groups(topo._dp_cp_ranks()) if dp * cp > 1 else None
        return topo

    # -- coordinates ------------------------------------------------------------------------
    @cached_property
    def coords(self) -> Coordinates:
        return coordinates_of(self.rank, self.tp, self.cp, self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and sum their gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place among them (its shard under zero 1-3)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.groups.get(name)

    def ranks_of(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (a mesh axis, ``mp`` or ``embedding``)."""
        if axis == "mp":
            return next(r for r in self._mp_ranks() if self.rank in r)
        if axis == "embedding":
            return next((r for r in self._embedding_ranks() if self.rank in r), [self.rank])
        if axis == "dp_cp":
            return next(r for r in self._dp_cp_ranks() if self.rank in r)
        size = getattr(self, axis)
        here = self.coords
        return [rank_of(Coordinates(**{**here.__dict__, axis: i}), self.tp, self.cp, self.dp)
                for i in range(size)]

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (the one that reads data)."""
        return self.ranks_of("tp")[0]

    # -- group enumeration (all groups, in a fixed order, for new_group) ----------------------
    def _mp_ranks(self) -> list[list[int]]:
        out = []
        for dp_rank in range(self.dp):
            for cp_rank in range(self.cp):
                out.append([rank_of(Coordinates(tp=t, cp=cp_rank, dp=dp_rank, pp=p), self.tp, self.cp, self.dp)
                            for p in range(self.pp) for t in range(self.tp)])
        return out

    def _dp_cp_ranks(self) -> list[list[int]]:
        """Per (tp, pp): the dp x cp ranks, in the order of their dp_cp_rank."""
        return [[rank_of(Coordinates(tp=t, cp=c, dp=d, pp=p), self.tp, self.cp, self.dp)
                 for d in range(self.dp) for c in range(self.cp)] for p in range(self.pp) for t in range(self.tp)]

    def _embedding_ranks(self) -> list[list[int]]:
        stages = sorted({0, self.pp - 1})
        return [[rank_of(Coordinates(tp=t, cp=c, dp=d, pp=p), self.tp, self.cp, self.dp) for p in stages]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def __repr__(self) -> str:
        c = self.coords
        return (f"Topology(tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}; rank {self.rank} at "
                f"tp={c.tp} cp={c.cp} dp={c.dp} pp={c.pp})")
