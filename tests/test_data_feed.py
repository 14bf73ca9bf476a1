"""DataFeed: who reads, what middle pipeline stages get, and resuming on another dp."""

import torch

from tessera.config import load_config
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed
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
