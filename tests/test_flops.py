"""The FLOPs count matches the formulas the peers report (../shared/peers)."""

import pytest

from tessera.config import ModelConfig
from tessera.models.flops import flops_per_token, peak_flops


def test_gpt_matches_megatron_formula():
    L, h, s, V = 24, 2048, 2048, 50304
    cfg = ModelConfig(family="gpt2", layers=L, hidden=h, heads=16, seq_len=s, vocab_size=V)
    megatron = 72 * L * h * h * (1 + s / (12 * h) + V / (12 * L * h))  # per token (B * s = 1 token)
    assert flops_per_token(cfg) == pytest.approx(megatron, rel=1e-12)


def test_llama_matches_the_peers_formula():
    L, h, s, V, heads, kv, ffn = 16, 2048, 2048, 128256, 32, 8, 8192
    cfg = ModelConfig(family="llama", layers=L, hidden=h, heads=heads, kv_heads=kv, ffn_hidden=ffn, seq_len=s,
                      vocab_size=V, tie_embeddings=False)
    hd = h // heads
    n_mat = L * (h * (heads + 2 * kv) * hd + h * h + 3 * h * ffn) + h * V
    assert flops_per_token(cfg) == pytest.approx(6 * n_mat + 6 * L * s * h, rel=1e-12)


def test_peak_flops_by_name():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("cpu") is None
