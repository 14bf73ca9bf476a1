"""GPTModel refuses what it cannot run with a clear error naming the problem (built directly,
without config.validate): attention heads that do not split over TP, sequences longer than its
position tables."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config import ModelConfig
from tessera.models import GPTModel, TPContext
from tessera.testing import run_ranks


def _heads_rank(rank: int, world: int) -> dict:
    # q / k / v widths divide by tp=2 while the head counts do not
    cases = {"heads": dict(family="gpt2", heads=3, hidden=24),
             "kv_heads": dict(family="llama", heads=4, kv_heads=1, hidden=32)}
    out = {}
    for name, kw in cases.items():
        try:
            GPTModel(ModelConfig(vocab_size=50, layers=1, seq_len=8, **kw), TPContext(group=dist.group.WORLD))
            out[name] = "built"
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.timeout(120)
def test_heads_not_divisible_by_tp_are_refused_naming_them():
    for result in run_ranks(_heads_rank, 2, timeout=90):
        assert "model.heads = 3 is not divisible by the TP size 2" in result["heads"]
        assert "model.kv_heads = 1 is not divisible by the TP size 2" in result["kv_heads"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_sequence_longer_than_seq_len_is_refused_naming_it(family):
    model = GPTModel(ModelConfig(family=family, vocab_size=50, hidden=32, heads=4, layers=1, seq_len=8))
    model.init_weights(0)
    model(torch.randint(0, 50, (2, 8)))  # seq_len itself runs
    with pytest.raises(ValueError, match=r"seq <= model.seq_len = 8, got shape \(2, 10\)"):
        model(torch.randint(0, 50, (2, 10)))


def test_a_later_stage_refuses_a_sequence_longer_than_the_rope_table():
    cfg = ModelConfig(family="llama", vocab_size=50, hidden=32, heads=4, layers=2, seq_len=8)
    stage = GPTModel(cfg, layer_range=range(1, 2), pre_process=False)
    stage.init_weights(0)
    with pytest.raises(ValueError, match="10 tokens is longer than the RoPE table of model.seq_len = 8"):
        stage(hidden=torch.randn(10, 2, 32))
