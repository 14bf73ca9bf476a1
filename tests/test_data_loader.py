"""MicroBatches driven by a MicroBatchCalculator: ramp-up, layout independence, resume."""

import numpy as np
import pytest
import torch

from tessera.data import MicroBatches, microbatch_counts
from tessera.optim import MicroBatchCalculator

SEQ = 5


class Rows:
    """Sample i is [i*100, i*100 + 1, ..., i*100 + SEQ]: the row says which sample it is."""

    def __getitem__(self, index):
        return np.arange(index * 100, index * 100 + SEQ + 1)


def sample_ids(micro_batches):
    return [int(r) // 100 for mb in micro_batches for r in mb["tokens"][:, 0]]


def ramp(dp):
    # global 12, micro 2, ramp 4 -> 12 by 4 over 16 samples: one increment every 8 samples.
    return MicroBatchCalculator(12, 2, dp, (4, 4, 16))


def test_rampup_follows_calculator_and_is_layout_independent():
    steps = 7
    expected = [4, 4, 8, 12, 12, 12, 12]
    one = MicroBatches(Rows(), batches=ramp(1), dp_rank=0)
    two = [MicroBatches(Rows(), batches=ramp(2), dp_rank=r) for r in range(2)]
    consumed = 0
    for t in range(steps):
        assert one.global_batch == two[0].global_batch == expected[t]
        rows1 = next(one)
        per_rank = [next(loader) for loader in two]
        batch = expected[t]
        assert len(rows1) == batch // 2 and all(len(p) == batch // 4 for p in per_rank)
        assert sample_ids(rows1) == list(range(consumed, consumed + batch))
        assert sample_ids(per_rank[0]) + sample_ids(per_rank[1]) == sample_ids(rows1)
        for mb in rows1 + per_rank[0]:
            assert set(mb) == {"tokens", "labels", "loss_mask"}
            assert mb["tokens"].shape == mb["labels"].shape == mb["loss_mask"].shape == (2, SEQ)
            assert mb["tokens"].dtype == torch.int64 and torch.equal(mb["labels"], mb["tokens"] + 1)
        consumed += batch
    assert one.consumed_samples == two[0].consumed_samples == two[1].consumed_samples == consumed


def old_rows(source, step, global_batch, micro_batch, dp, dp_rank):
    share = global_batch // dp
    first = step * global_batch + dp_rank * share
    return [np.stack([source[first + m * micro_batch + j] for j in range(micro_batch)])
            for m in range(share // micro_batch)]


@pytest.mark.parametrize("start_step", [0, 3])
def test_constant_batch_matches_old_layout(start_step):
    from tessera.data import SyntheticTokens

    source = SyntheticTokens(SEQ, 50, seed=1)
    for rank in range(2):
        loader = MicroBatches(source, global_batch=8, micro_batch=2, dp=2, dp_rank=rank, start_step=start_step)
        assert loader.num_micro_batches == 2
        for step in range(start_step, start_step + 3):
            got = next(loader)
            want = old_rows(source, step, 8, 2, 2, rank)
            assert len(got) == len(want)
            for mb, rows in zip(got, want):
                assert torch.equal(mb["tokens"], torch.from_numpy(rows[:, :-1].astype(np.int64)))
                assert torch.equal(mb["labels"], torch.from_numpy(rows[:, 1:].astype(np.int64)))
        assert loader.step == start_step + 3 and loader.consumed_samples == (start_step + 3) * 8


def test_constant_batch_divisibility_refused():
    with pytest.raises(ValueError, match="not divisible"):
        MicroBatches(Rows(), global_batch=6, micro_batch=2, dp=2, dp_rank=0)


def test_batches_argument_checks():
    with pytest.raises(ValueError, match="start_step"):
        MicroBatches(Rows(), batches=ramp(2), dp_rank=0, start_step=1)
    with pytest.raises(ValueError, match="dp=1"):
        MicroBatches(Rows(), batches=ramp(2), dp=1, dp_rank=0)
    with pytest.raises(ValueError, match="not both"):
        MicroBatches(Rows(), batches=ramp(2), global_batch=12, dp_rank=0)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_resume_from_state_dict(k):
    original = MicroBatches(Rows(), batches=ramp(2), dp_rank=1)
    for _ in range(k):
        next(original)
    restored_calc = ramp(2)
    restored_calc.load_state_dict(original.batches.state_dict())
    restored = MicroBatches(Rows(), batches=restored_calc, dp_rank=1)
    for _ in range(3):
        a, b = next(original), next(restored)
        assert len(a) == len(b) and all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))


def test_microbatch_counts():
    calc = ramp(1)
    assert microbatch_counts(calc, 0) == []
    assert microbatch_counts(calc, 1) == [2]
    assert microbatch_counts(calc, 3) == [2, 4]
    assert microbatch_counts(calc, 1000) == [2, 4, 6]
    assert microbatch_counts(ramp(2), 1000) == [1, 2, 3]
    assert microbatch_counts(calc, 2, consumed_samples=8) == [4, 6]
    assert calc.consumed_samples == 0
    calc.advance(), calc.advance(), calc.advance()  # consumed 16: the full batch from here on
    assert microbatch_counts(calc, 5) == [6] and calc.consumed_samples == 16
    assert microbatch_counts(MicroBatchCalculator(16, 2, 2), 10) == [4]
    # agrees with what a loader yields
    loader = MicroBatches(Rows(), batches=ramp(2), dp_rank=0)
    assert sorted({len(next(loader)) for _ in range(6)}) == microbatch_counts(ramp(2), 6)


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_token_ids_outside_the_vocabulary_are_refused(bad):
    """Sample 5's last id is bad: the error names the sample, the id and model.vocab_size."""
    from tessera.config import ConfigError

    class Ids:
        def __getitem__(self, index):
            return np.array([1, 2, 63, bad if index == 5 else 0], dtype=np.int32)

    loader = MicroBatches(Ids(), global_batch=4, micro_batch=2, dp=1, dp_rank=0, vocab_size=64)
    assert len(next(loader)) == 2  # samples 0-3 hold ids up to 63
    with pytest.raises(ConfigError, match=rf"model.vocab_size: sample 5 holds token id {bad}, outside .*\[0, 64\)"):
        next(loader)
    ok = MicroBatches(Ids(), global_batch=4, micro_batch=2, dp=1, dp_rank=0, start_step=1, vocab_size=1001)
    if bad >= 0:
        assert next(ok)[0]["labels"][1, -1] == bad
