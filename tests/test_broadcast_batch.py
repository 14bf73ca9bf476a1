"""broadcast_batch: only the TP source rank reads the batch; every rank of its TP group gets it."""

from __future__ import annotations

import pytest
import torch

from tessera.tensor_parallel import broadcast_batch
from tessera.tensor_parallel.data import batch_header
from tessera.testing import run_ranks
from tessera.topology import Topology

TIMEOUT = 90
CPU = torch.device("cpu")


def make_batch(dp_rank: int, step: int) -> dict[str, torch.Tensor]:
    """What the data loader of data-parallel replica ``dp_rank`` reads at ``step``."""
    g = torch.Generator().manual_seed(1000 * dp_rank + step)
    seq = 8 if step == 0 else 5  # the shapes change between steps: the header must follow
    tokens = torch.randint(0, 50_000, (2, seq + 1), generator=g)
    return {
        "tokens": tokens[:, :-1],                                       # a non-contiguous view
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": (torch.rand(2, seq, generator=g) > 0.2).float(),
        "attention_mask": torch.rand(2, seq, generator=g) > 0.5,        # bool
        "position_ids": torch.arange(seq).expand(2, seq),               # stride 0 along dim 0
        "weights": torch.randn(seq, 3, generator=g, dtype=torch.float64).t(),  # transposed
        "step": torch.tensor(step, dtype=torch.int32),                  # 0-d
    }


def _broadcast_rank(rank: int, world_size: int) -> dict:
    topo = Topology.build(tp=2)
    group, src = topo.group("tp"), topo.tp_src_rank
    assert topo.tp == 2 and topo.dp == world_size // 2 and group is not None
    assert src == rank - topo.tp_rank, (src, rank)
    is_src = topo.tp_rank == 0
    if is_src:
        try:  # the source must provide the batch (it raises before communicating)
            broadcast_batch(None, group, src, CPU)
        except ValueError:
            pass
        else:
            raise AssertionError("TP rank 0 passed None and broadcast_batch did not refuse")
        wrong = [(k, (3, *shape[1:]) if shape else shape, dtype) for k, shape, dtype in batch_header(make_batch(0, 1))]
        try:  # a batch that is not what the others expect is refused before communicating
            broadcast_batch(make_batch(topo.dp_rank, 1), group, src, CPU, header=wrong)
        except ValueError as e:
            assert "the other TP ranks expect" in str(e), e
        else:
            raise AssertionError("a batch unlike the given header was broadcast")
    received = []
    for step in range(3):  # step 0 broadcasts the header; steps 1, 2 are given it, as the data feed does
        batch = make_batch(topo.dp_rank, min(step, 1)) if is_src else None
        header = batch_header(make_batch(0, 1)) if step else None
        out = broadcast_batch(batch, group, src, CPU, header)
        expected = make_batch(topo.dp_rank, min(step, 1))
        assert list(out) == list(expected), f"keys {list(out)} != {list(expected)}"
        for k, v in expected.items():
            assert out[k].device == CPU and out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(out[k], v), f"rank {rank} step {step}: {k} differs from its source's"
        received.append({k: v.clone() for k, v in out.items()})
    return dict(dp_rank=topo.dp_rank, tp_rank=topo.tp_rank, batches=received)


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "tp2xdp2"])
def test_broadcast_batch_within_tp_groups(world_size):
    out = run_ranks(_broadcast_rank, world_size, timeout=TIMEOUT)
    assert [(o["dp_rank"], o["tp_rank"]) for o in out] == [(r // 2, r % 2) for r in range(world_size)]
    for o in out:
        for step, batch in enumerate(o["batches"]):
            src = out[2 * o["dp_rank"]]["batches"][step]  # what this rank's TP source holds
            expected = make_batch(o["dp_rank"], min(step, 1))
            assert list(batch) == list(expected)
            for k in expected:
                assert torch.equal(batch[k], src[k]) and torch.equal(batch[k], expected[k])
    if world_size == 4:
        # the two TP groups broadcast their own sources' batches, not each other's
        for step in range(2):
            a, b = out[0]["batches"][step], out[2]["batches"][step]
            assert not torch.equal(a["tokens"], b["tokens"])
            assert not torch.equal(a["weights"], b["weights"])


def test_broadcast_batch_single_rank():
    """tp=1: the batch is returned as it is (on the device)."""
    batch = make_batch(0, 0)
    out = broadcast_batch(batch, None, 0, CPU)
    assert list(out) == list(batch)
    assert all(torch.equal(out[k], batch[k]) and out[k].dtype == batch[k].dtype for k in batch)
