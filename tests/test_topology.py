"""Topology: sizes, coordinates, group membership, real process groups, the DeviceMesh.

Expected values are computed here from the documented layout (tp fastest, then cp, dp, pp)::

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

independently of the helpers in ``tessera.topology``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from tessera.testing import run_ranks
from tessera.topology import Topology

AXES = ("tp", "cp", "dp", "pp")  # fastest to slowest


# -- the reference layout, written out by hand ---------------------------------------------------
def _rank(c: dict[str, int], s: dict[str, int]) -> int:
    return c["tp"] + s["tp"] * (c["cp"] + s["cp"] * (c["dp"] + s["dp"] * c["pp"]))


def _grid(s: dict[str, int]) -> dict[int, dict[str, int]]:
    """Every global rank -> its coordinates, by brute-force enumeration."""
    out = {}
    for pp, dp, cp, tp in itertools.product(*(range(s[a]) for a in ("pp", "dp", "cp", "tp"))):
        c = dict(tp=tp, cp=cp, dp=dp, pp=pp)
        out[_rank(c, s)] = c
    assert sorted(out) == list(range(len(out)))
    return out


def _expected_members(rank: int, s: dict[str, int]) -> dict[str, list[int]]:
    grid = _grid(s)
    me = grid[rank]

    def same(r, keys):
        return all(grid[r][k] == me[k] for k in keys)

    out = {axis: sorted(r for r in grid if same(r, [a for a in AXES if a != axis])) for axis in AXES}
    out["mp"] = sorted(r for r in grid if same(r, ["cp", "dp"]))  # all tp x pp of this replica
    # dp x cp: the ranks that hold the same weights (cp splits the sequence), in dp_cp_rank order
    out["dp_cp"] = sorted((r for r in grid if same(r, ["tp", "pp"])), key=lambda r: (grid[r]["dp"], grid[r]["cp"]))
    last = s["pp"] - 1
    if me["pp"] in (0, last):
        out["embedding"] = sorted(r for r in grid if same(r, ["tp", "cp", "dp"]) and grid[r]["pp"] in (0, last))
    else:
        out["embedding"] = [rank]
    return out


def _check_topology(topo: Topology, rank: int, s: dict[str, int]) -> dict:
    """Check one rank's view of a layout; return what the parent cross-checks."""
    world = s["tp"] * s["cp"] * s["dp"] * s["pp"]
    assert (topo.tp, topo.cp, topo.dp, topo.pp) == (s["tp"], s["cp"], s["dp"], s["pp"])
    assert topo.world_size == world == dist.get_world_size()
    assert topo.rank == rank
    me = _grid(s)[rank]
    assert (topo.tp_rank, topo.cp_rank, topo.dp_rank, topo.pp_rank) == (me["tp"], me["cp"], me["dp"], me["pp"])
    coords = topo.coords
    assert (coords.tp, coords.cp, coords.dp, coords.pp) == (me["tp"], me["cp"], me["dp"], me["pp"])
    assert topo.is_first_stage == (me["pp"] == 0)
    assert topo.is_last_stage == (me["pp"] == s["pp"] - 1)

    expected = _expected_members(rank, s)
    assert topo.tp_src_rank == expected["tp"][0]
    for name, members in expected.items():
        assert topo.ranks_of(name) == members, (name, topo.ranks_of(name), members)
        group = topo.group(name)
        if len(members) == 1:
            assert group is None, f"{name}: a group of one rank must be None"
        else:
            assert group is not None, f"{name}: missing process group"
            assert dist.get_process_group_ranks(group) == members, name
            assert dist.get_world_size(group) == len(members)
            assert dist.get_rank(group) == members.index(rank)
            # a real collective over the real group
            x = torch.tensor([float(rank), 1.0])
            dist.all_reduce(x, group=group)
            assert x.tolist() == [float(sum(members)), float(len(members))], (name, x)
    assert topo.dp_cp == s["dp"] * s["cp"] and topo.dp_cp_rank == expected["dp_cp"].index(rank)
    if s["cp"] == 1:  # without cp the gradients' group is dp itself (no second communicator)
        assert topo.group("dp_cp") is topo.group("dp")
    # dp_scalars: the dp x cp ranks on a communicator of their own (not the gradients' group object)
    scalars = topo.group("dp_scalars")
    if s["dp"] * s["cp"] == 1:
        assert scalars is None
    else:
        assert scalars is not None and scalars is not topo.group("dp_cp")
        assert sorted(dist.get_process_group_ranks(scalars)) == sorted(expected["dp_cp"])
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=scalars)
        assert x.item() == float(sum(expected["dp_cp"]))
    if topo.dp_mesh is not None and s["dp"] * s["cp"] > 1:  # FSDP's mesh: the dp x cp ranks
        assert dist.get_process_group_ranks(topo.dp_mesh.get_group()) == expected["dp_cp"]
    # The embedding group holds the first and last stage (or nothing if this rank is neither).
    if s["pp"] > 1 and me["pp"] in (0, s["pp"] - 1):
        stages = sorted({_grid(s)[r]["pp"] for r in topo.ranks_of("embedding")})
        assert stages == [0, s["pp"] - 1]

    mesh = topo.mesh
    assert mesh is not None
    assert tuple(mesh.mesh_dim_names) == ("pp", "dp", "cp", "tp")
    assert tuple(mesh.mesh.shape) == (s["pp"], s["dp"], s["cp"], s["tp"])
    assert torch.equal(mesh.mesh, torch.arange(world).view(s["pp"], s["dp"], s["cp"], s["tp"]))
    assert list(mesh.get_coordinate()) == [me["pp"], me["dp"], me["cp"], me["tp"]]
    for axis in ("pp", "dp", "cp", "tp"):
        assert mesh.size(("pp", "dp", "cp", "tp").index(axis)) == s[axis]
        if s[axis] > 1:
            assert dist.get_process_group_ranks(mesh.get_group(axis)) == expected[axis]
    return {name: topo.ranks_of(name) for name in expected}


def _layouts_worker(rank: int, world_size: int, layouts: list[dict]) -> list[dict]:
    out = []
    for kwargs in layouts:
        topo = Topology.build(**kwargs)
        s = dict(tp=kwargs.get("tp", 1), cp=kwargs.get("cp", 1), pp=kwargs.get("pp", 1))
        s["dp"] = kwargs.get("dp") or world_size // (s["tp"] * s["cp"] * s["pp"])
        out.append(_check_topology(topo, rank, s))
    # A layout that does not multiply to the world size is refused on every rank.
    try:
        Topology.build(tp=2, pp=1, dp=world_size)
    except ValueError as e:
        assert "world size" in str(e), e
    else:
        raise AssertionError("tp*dp != world size was accepted")
    return out


def _check_partition(results: list[list[dict]], world_size: int) -> None:
    """Across ranks, each axis's groups partition the world and agree with each other."""
    for i in range(len(results[0])):
        for name in ("tp", "cp", "dp", "pp", "mp", "embedding"):
            views = [results[r][i][name] for r in range(world_size)]
            for r, members in enumerate(views):
                assert r in members
                for m in members:  # every member sees the same group
                    assert views[m] == members
            if name != "embedding":
                assert len({tuple(v) for v in views}) * len(views[0]) == world_size


LAYOUTS_4 = [
    dict(tp=4),
    dict(tp=2, pp=2),
    dict(tp=2, dp=2),
    dict(tp=2),  # dp derived = 2
    dict(tp=1, pp=2, dp=2),
    dict(tp=1, pp=4),
    dict(dp=4),
    dict(tp=1, cp=2, pp=2),
    dict(tp=1, cp=2, dp=2),
]

LAYOUTS_8 = [
    dict(tp=2, pp=2, dp=2),
    dict(tp=4, pp=2),
    dict(tp=2, pp=4),
    dict(tp=1, pp=2, dp=4),
    dict(tp=8),
    dict(tp=2, cp=2, pp=2),
    dict(tp=2, cp=2, dp=2),
    dict(tp=2, pp=1, dp=4),
]


def test_layouts_world4():
    results = run_ranks(_layouts_worker, 4, LAYOUTS_4, timeout=120)
    assert len(results) == 4
    _check_partition(results, 4)


@pytest.mark.slow
def test_layouts_world8():
    results = run_ranks(_layouts_worker, 8, LAYOUTS_8, timeout=150)
    assert len(results) == 8
    _check_partition(results, 8)


def test_single_rank_without_process_group():
    assert not dist.is_initialized()
    topo = Topology.build()
    assert (topo.tp, topo.cp, topo.dp, topo.pp, topo.rank, topo.world_size) == (1, 1, 1, 1, 0, 1)
    assert (topo.tp_rank, topo.cp_rank, topo.dp_rank, topo.pp_rank) == (0, 0, 0, 0)
    assert topo.is_first_stage and topo.is_last_stage
    for name in ("tp", "cp", "dp", "pp", "mp", "embedding"):
        assert topo.group(name) is None
        assert topo.ranks_of(name) == [0]
    assert topo.tp_src_rank == 0
    assert Topology.build(tp=1, pp=1, dp=1).world_size == 1
    with pytest.raises(RuntimeError):
        Topology.build(tp=2)
    with pytest.raises(RuntimeError):
        Topology.build(pp=2)


def _coexist_worker(rank: int, world_size: int) -> dict:
    a = Topology.build(tp=2, pp=2)  # dp = 2
    b = Topology.build(tp=4)  # dp = 2
    c = Topology.build(tp=2, pp=4)  # dp = 1
    one = torch.tensor([float(rank)])

    def reduce(topo, axis):
        x = one.clone()
        dist.all_reduce(x, group=topo.group(axis))
        return x.item()

    # Interleave collectives on the three layouts' groups: each uses its own members.
    got = {
        "a.tp": reduce(a, "tp"), "b.tp": reduce(b, "tp"), "c.tp": reduce(c, "tp"),
        "b.dp": reduce(b, "dp"), "a.dp": reduce(a, "dp"), "c.pp": reduce(c, "pp"),
        "a.pp": reduce(a, "pp"), "a.tp2": reduce(a, "tp"),
    }
    expected_tp_a = sum(r for r in range(world_size) if r // 2 == rank // 2)
    expected_tp_b = sum(r for r in range(world_size) if r // 4 == rank // 4)
    assert got["a.tp"] == got["a.tp2"] == expected_tp_a
    assert got["b.tp"] == expected_tp_b
    assert got["c.tp"] == expected_tp_a
    # a: dp is the ranks with the same tp and pp: rank % 2 and rank // 4 fixed
    assert got["a.dp"] == sum(r for r in range(world_size) if r % 2 == rank % 2 and r // 4 == rank // 4)
    assert got["b.dp"] == sum(r for r in range(world_size) if r % 4 == rank % 4)
    assert got["a.pp"] == sum(r for r in range(world_size) if r % 4 == rank % 4)
    assert got["c.pp"] == sum(r for r in range(world_size) if r % 2 == rank % 2)
    # The first topology is unchanged by building the others.
    for topo, s in ((a, dict(tp=2, cp=1, dp=2, pp=2)), (b, dict(tp=4, cp=1, dp=2, pp=1)),
                    (c, dict(tp=2, cp=1, dp=1, pp=4))):
        _check_topology(topo, rank, s)
    return got


@pytest.mark.slow
def test_two_topologies_coexist():
    got = run_ranks(_coexist_worker, 8, timeout=150)
    assert [g["a.tp"] for g in got] == [1, 1, 5, 5, 9, 9, 13, 13]
    assert [g["b.tp"] for g in got] == [6] * 4 + [22] * 4


def _dp_sum_worker(rank: int, world_size: int) -> float:
    topo = Topology.build(tp=2)  # dp = 2 in a 4-rank world: dp groups {0, 2}, {1, 3}
    x = torch.tensor([float(rank) + 1.0])
    dist.all_reduce(x, group=topo.group("dp"))
    y = torch.full((3,), float(rank))
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=topo.group("tp"))
    assert y.tolist() == [float(rank | 1)] * 3
    return x.item()


def test_all_reduce_over_dp_group():
    assert run_ranks(_dp_sum_worker, 4, timeout=60) == [4.0, 6.0, 4.0, 6.0]
