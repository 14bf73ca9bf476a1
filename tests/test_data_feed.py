"""DataFeed: who reads, what middle pipeline stages get, resuming on another dp, and each ramped
global batch split over dp exactly once."""

import pytest
import torch

from tessera.config import load_config
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed, build_source
from tessera.training.preflight import validate

BASE = ["data.source=synthetic", "model.seq_len=16", "model.vocab_size=50", "train.micro_batch=2",
        "train.global_batch=8", "train.steps=20"]


def feed(dp: int, pp: int, rank: int, extra=()) -> DataFeed:
    cfg = validate(load_config(None, BASE + [f"parallel.pp={pp}", *extra]), dp * pp)
    return DataFeed(cfg, Topology(tp=1, cp=1, dp=dp, pp=pp, rank=rank, device=torch.device("cpu")))


def rows(micro_batches) -> torch.Tensor:
    return torch.cat([mb["tokens"] for mb in micro_batches])


def test_middle_stages_read_nothing_and_follow_the_ramp():
    ramp = ["train.batch_rampup=4,4,8"]
    first, middle, last = (feed(1, 3, r, ramp) for r in range(3))
    assert middle.loader is None and first.loader is not None and last.loader is not None
    for _ in range(4):
        a, b, c = first.next(), middle.next(), last.next()
        assert len(a) == len(b) == len(c) and all(mb == {} for mb in b)
        assert torch.equal(rows(a), rows(c))
    assert [len(f.next()) for f in (first, middle, last)] == [4, 4, 4]  # ramp done: 8 / 2
    assert middle.state_dict() == first.state_dict()


def test_packed_sequences_make_middle_stages_read():
    packed = ["data.eod_id=0", "data.reset_attention_mask=true"]
    middle = feed(1, 3, 1, packed)
    step = middle.next()
    assert middle.loader is not None and "document_ids" in step[0] and "tokens" in step[0]


def test_resume_with_another_dp_sees_the_same_samples():
    two = [feed(2, 1, r) for r in range(2)]
    for _ in range(3):
        for f in two:
            f.next()
    state = two[0].state_dict()
    expected = torch.cat([rows(f.next()) for f in two])  # the 4th step over both dp ranks
    one = feed(1, 1, 0)
    one.load_state_dict(state)
    assert torch.equal(rows(one.next()), expected)


# -- the dp split under a ramp-up -----------------------------------------------------------------------------
FEED = ["data.source=synthetic", "model.seq_len=16", "model.vocab_size=64", "train.micro_batch=1",
        "train.global_batch=16", "train.steps=8", "train.batch_rampup=4,4,24", "train.seed=3"]
# one increment per 8 samples: steps 3 and 4 start exactly on a slice boundary (8, 16 consumed)
FEED_BATCHES = [4, 4, 8, 12, 16, 16, 16, 16]


def _feed_split(topo: Topology) -> dict:
    """Each step's rows on this rank, as the global sample numbers they are (the source's rows
    are unique: 17 random ids of 64), and the feed's state after the steps."""
    cfg = validate(load_config(None, FEED + [f"parallel.tp={topo.tp}", f"parallel.dp={topo.dp}"]), topo.world_size)
    feed, source = DataFeed(cfg, topo), build_source(cfg)
    index = {tuple(source[i][:-1]): i for i in range(sum(FEED_BATCHES) + 32)}
    steps = []
    for _ in FEED_BATCHES:
        rows = torch.cat([mb["tokens"] for mb in feed.next()])
        steps.append([index.get(tuple(r.tolist()), -1) for r in rows])
    return {"dp_rank": topo.dp_rank, "tp_rank": topo.tp_rank, "steps": steps, "state": feed.state_dict()}


def _check_feed_split(ranks: list[dict], dp: int) -> None:
    consumed = 0
    for t, batch in enumerate(FEED_BATCHES):
        by_dp = {}
        for r in ranks:
            got = r["steps"][t]
            assert len(got) == batch // dp, (t, r["dp_rank"], got)
            assert by_dp.setdefault(r["dp_rank"], got) == got, f"step {t}: TP ranks of dp {r['dp_rank']} differ"
        # dp rank d takes the d-th contiguous share: every sample of the global batch exactly once
        assert [i for d in range(dp) for i in by_dp[d]] == list(range(consumed, consumed + batch)), (t, by_dp)
        consumed += batch
    assert all(r["state"]["consumed_samples"] == consumed for r in ranks)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_feed_splits_each_ramped_global_batch_over_dp_exactly_once(dp):
    """DataFeed (one process per dp rank, tp=1): under a ramp-up of 4 -> 16 samples every global
    batch is split into dp contiguous shares that together hold samples [c, c + G_t) once each,
    G_t following the calculator (4, 4, 8, 12, 16, ...)."""
    ranks = [_feed_split(Topology(tp=1, cp=1, dp=dp, pp=1, rank=r, device=torch.device("cpu"))) for r in range(dp)]
    _check_feed_split(ranks, dp)


def _feed_split_worker(rank: int, world: int) -> dict:
    return _feed_split(Topology.build(tp=2, dp=2))


@pytest.mark.timeout(180)
def test_tp_ranks_of_a_dp_rank_get_its_share_of_each_ramped_global_batch():
    """tp=2 x dp=2: the TP source rank reads, the TP broadcast gives its peer the same rows."""
    _check_feed_split(run_ranks(_feed_split_worker, 4, timeout=120), dp=2)
