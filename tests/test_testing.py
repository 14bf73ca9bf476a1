"""The multi-rank harness: results by rank (tensors too), a failing rank's traceback, a deadline."""

import time

import pytest
import torch
import torch.distributed as dist

from tessera.testing import RankError, run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return [t, torch.full((1000,), float(rank))]


def _one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("shape mismatch on purpose")
    time.sleep(600)  # (a rank waiting for its failed peer, until killed)


def _hangs(rank, world_size):
    if rank == 0:
        time.sleep(600)
    dist.barrier()


def test_results_by_rank():
    out = run_ranks(_sum_ranks, 4, timeout=60)
    assert [o[0].item() for o in out] == [6.0] * 4
    assert [o[1][-1].item() for o in out] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(300)
def test_a_failing_rank_is_reported_before_the_deadline():
    """Rank 1 fails while rank 0 would run on for 10 minutes: the failure, with its traceback,
    comes before the deadline (which would raise TimeoutError instead) and the other rank is
    killed."""
    with pytest.raises(RankError, match="rank 1 of 2 failed(.|\n)*shape mismatch on purpose"):
        run_ranks(_one_fails, 2, timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hang_hits_the_deadline():
    """Rank 0 sleeps 10 minutes (rank 1 waits for it): the deadline (3 s) ends the call, naming
    the ranks still running."""
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 3s"):
        run_ranks(_hangs, 2, timeout=3)
