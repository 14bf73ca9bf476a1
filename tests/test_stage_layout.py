"""parallel.pp_layout: balanced (layers per virtual stage by time, the output head counted at its
FLOPs times HEAD_TIME_PER_FLOP), even, and auto (the default: balanced when vpp > 1, else even)."""

import itertools

import pytest

from tessera.config import ModelConfig, load_config
from tessera.pipeline_parallel.stage import (
    HEAD_TIME_PER_FLOP,
    LayoutError,
    balanced_layout,
    parse_layout,
    stage_layer_ranges,
)
from tessera.models.flops import (
    flops_per_token,
    head_matmul_weights,
    layer_flops_per_token,
)


def busiest(cfg: ModelConfig, layout) -> float:
    work = [n * layer_flops_per_token(cfg) for n in layout]
    work[-1] += HEAD_TIME_PER_FLOP * 6.0 * head_matmul_weights(cfg)
    return max(work)


@pytest.mark.parametrize("layers,vocab,pp,vpp", [(8, 1000, 2, 1), (8, 20000, 2, 1), (9, 50000, 3, 1),
                                                  (8, 30000, 2, 2), (6, 300, 3, 2), (7, 90000, 4, 1)])
def test_balanced_layout_minimises_the_busiest_stage(layers, vocab, pp, vpp):
    cfg = ModelConfig(hidden=64, heads=4, layers=layers, seq_len=32, vocab_size=vocab)
    got = balanced_layout(cfg, pp, vpp)
    assert sum(got) == layers and min(got) >= 1 and len(got) == pp * vpp
    stage_layer_ranges(layers, pp, vpp, got)  # a valid layout
    best = min(busiest(cfg, c) for c in itertools.product(range(1, layers + 1), repeat=pp * vpp) if sum(c) == layers)
    assert busiest(cfg, got) == pytest.approx(best)


def test_gpt_1_3b_at_pp2_moves_two_layers_off_the_head_stage():
    cfg = ModelConfig(hidden=2048, heads=16, layers=24, seq_len=2048, vocab_size=50304)
    assert balanced_layout(cfg, 2) == [13, 11]
    assert busiest(cfg, [13, 11]) < busiest(cfg, [12, 12])
    assert balanced_layout(cfg, 2, 2) == [7, 6, 6, 5]  # measured fastest at vpp=2 (BENCHMARKS.md, Pipeline parallelism)
    # the head is what the split accounts for: the whole model's FLOPs are the layers' plus it
    assert flops_per_token(cfg) == pytest.approx(24 * layer_flops_per_token(cfg) + 6.0 * head_matmul_weights(cfg))


def test_the_head_counts_at_its_time_not_its_flops():
    """Llama-1B's untied 128k head is 4.0 layers by FLOPs but ran in 2.5 layers' time (2026-11-27):
    by FLOPs the split would be 10/6 per rank (0.811 of one GPU), by time 9/7 (0.827-0.833)."""
    llama = ModelConfig(family="llama", hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, layers=16,
                        seq_len=2048, vocab_size=128256, tie_embeddings=False)
    assert 6.0 * head_matmul_weights(llama) / layer_flops_per_token(llama) == pytest.approx(4.04, abs=0.01)
    assert 0.55 <= HEAD_TIME_PER_FLOP <= 0.7  # 9.6 ms / 3.8 ms per layer / 4.04 = 0.62
    assert balanced_layout(llama, 2, 2) == [5, 5, 4, 2] and balanced_layout(llama, 2) == [9, 7]


def test_layouts_are_parsed_by_name_auto_by_default_and_refused_when_they_cannot_be():
    cfg = load_config(None, ["model.layers=5", "model.hidden=64", "model.heads=4", "model.vocab_size=256",
                             "parallel.pp_layout=balanced"])
    assert parse_layout(cfg.parallel.pp_layout, cfg.model, 2, 1) == [3, 2]
    assert parse_layout(" BALANCED ", cfg.model, 2, 1) == [3, 2]
    with pytest.raises(LayoutError, match="every stage needs a layer"):
        parse_layout("balanced", cfg.model, 4, 2)
    # auto (the default): balanced with virtual stages, even without; "even" and "" are even
    assert load_config(None, []).parallel.pp_layout == "auto"
    assert parse_layout("auto", cfg.model, 2, 2) == balanced_layout(cfg.model, 2, 2)
    assert parse_layout("auto", cfg.model, 2, 1) is None
    assert parse_layout(" Even ", cfg.model, 2, 2) is None and parse_layout("", cfg.model, 2, 2) is None
    with pytest.raises(LayoutError, match="pp_layout=balanced needs the model config"):
        parse_layout("balanced")
    with pytest.raises(LayoutError, match="pp_layout=auto needs the model config"):
        parse_layout("auto", None, 2, 2)
