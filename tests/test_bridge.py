"""The bridge between pipeline stages on different grids: every receiving rank gets exactly its
share of the sending stage's activations (batch rows over its dp, sequence slice under sequence
parallelism), and gradients travel back to every sending rank's share, for tp/dp changes either
way, with and without sequence parallelism, on 4 and 5 gloo ranks; and the piece lists alone."""

from __future__ import annotations

import pytest
import torch

from tessera.pipeline_parallel.bridge import Bridge, pieces, share
from tessera.stage_topology import StageGrid, StageTopology
from tessera.testing import run_ranks

SEQ, BATCH, HIDDEN = 8, 4, 3


def _global(seed: int) -> torch.Tensor:
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _part(x: torch.Tensor, box) -> torch.Tensor:
    (s0, s1), (b0, b1) = box
    return x[s0:s1, b0:b1]


def _exchange(rank, world, stage_tp, stage_dp, sp):
    """Every stage sends two micro-batches forward and their gradients back; returns what each
    rank received, as (stream, micro-batch, tensor)."""
    topo = StageTopology.build_stages(stage_tp, stage_dp)
    bridge = Bridge(topo, sequence_parallel=sp, match_in_order=False, keep_shapes=True)
    grid, c = topo.grid, topo.coords
    got = []
    for step in range(2):  # the second step reuses the negotiated shapes
        bridge.new_step()
        for mb in range(2):
            x, g = _global(10 * step + mb), _global(100 + 10 * step + mb)
            mine = share(grid, c.pp, c.tp, c.dp, SEQ, BATCH, sp)
            recv_f = bridge.recv("F", c.pp - 1, mb) if c.pp > 0 else None
            recv_b = bridge.recv("B", c.pp + 1, mb) if c.pp < grid.pp - 1 else None
            if c.pp < grid.pp - 1:
                bridge.send("F", c.pp + 1, mb, _part(x, mine).clone())
            if c.pp > 0:
                bridge.send("B", c.pp - 1, mb, _part(g, mine).clone())
            if recv_f is not None:
                got.append(("F", step, mb, recv_f.wait().clone(), _part(x, mine)))
            if recv_b is not None:
                got.append(("B", step, mb, recv_b.wait().clone(), _part(g, mine)))
        bridge.wait_sends()
    return [(rank, *item) for item in got]


LAYOUTS = [
    ([2, 1], [1, 2], False), ([2, 1], [1, 2], True),
    ([1, 2], [2, 1], False), ([1, 2], [2, 1], True),
    ([2, 1, 2], [1, 1, 1], False), ([2, 1, 2], [1, 1, 1], True),
]


@pytest.mark.slow
@pytest.mark.parametrize("stage_tp,stage_dp,sp", LAYOUTS)
def test_bridge_carries_shares(stage_tp, stage_dp, sp):
    world = sum(t * d for t, d in zip(stage_tp, stage_dp))
    results = run_ranks(_exchange, world, stage_tp, stage_dp, sp, timeout=120)
    seen = 0
    for per_rank in results:
        for rank, stream, step, mb, got, want in per_rank:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} {stream} step {step} mb {mb}")
            seen += 1
    stages = len(stage_tp)
    assert seen == 2 * 2 * sum(stage_tp[s] * stage_dp[s] * ((s > 0) + (s < stages - 1)) for s in range(stages))


def test_pieces_cover_every_share_once():
    grid = StageGrid((2, 1, 4), (1, 2, 1))
    for src, dst in ((0, 1), (1, 2), (2, 1), (1, 0)):
        for sp in (False, True):
            moved = pieces(grid, src, dst, SEQ, BATCH, sp)
            for d_dp in range(grid.stage_dp[dst]):
                for d_tp in range(grid.stage_tp[dst]):
                    rank = grid.rank_of(dst, d_tp, d_dp)
                    (s0, s1), (b0, b1) = share(grid, dst, d_tp, d_dp, SEQ, BATCH, sp)
                    covered = torch.zeros(SEQ, BATCH, dtype=torch.int64)
                    for _, to, ((q0, q1), (r0, r1)) in moved:
                        if to == rank:
                            covered[q0:q1, r0:r1] += 1
                    assert covered[s0:s1, b0:b1].eq(1).all() and covered.sum() == (s1 - s0) * (b1 - b0)


def test_equal_grids_move_whole_shares():
    """Neighbouring stages of one shape: each rank's share goes whole to its counterpart."""
    grid = StageGrid((2, 2, 1), (1, 1, 2))
    for sp in (False, True):
        assert pieces(grid, 0, 1, SEQ, BATCH, sp) == tuple(
            (t, 2 + t, share(grid, 0, t, 0, SEQ, BATCH, sp)) for t in range(2))
