"""Generation on a GPU (gpu-marked, skipped elsewhere): the KV cache's decode steps, eager,
replayed from one CUDA graph, and compiled by inductor then replayed, draw what the
whole-context reference draws on the same GPU."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.inference.generate import generate
from tessera.inference.sampling import Sampling
from tessera.models.transformer import TPContext
from tessera.pipeline_parallel.stage import build_stage_chunks
from tessera.topology import Topology

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LLAMA = ModelConfig(family="llama", vocab_size=96, hidden=64, heads=4, kv_heads=2, layers=3, seq_len=32,
                    tie_embeddings=False)
GPT2 = ModelConfig(vocab_size=96, hidden=64, heads=4, layers=3, seq_len=32)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12]]


def _chunks(cfg: ModelConfig, topo: Topology):
    chunks = build_stage_chunks(cfg, TPContext(group=None), 0, 1, 1, None, topo.device)
    for chunk in chunks:
        chunk.init_weights(7)
    return chunks


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=20, seed=3)], ids=["greedy", "top-k"])
def test_eager_graphed_and_compiled_decode_draw_what_the_whole_context_draws_on_a_gpu(cfg, sampling):
    topo = Topology.build(device="cuda")
    chunks = _chunks(cfg, topo)
    new = cfg.seq_len + 5  # (past seq_len: the cache slides)
    reference = generate(chunks, PROMPTS, new, topo=topo, sampling=sampling, use_cache=False)
    assert generate(chunks, PROMPTS, new, topo=topo, sampling=sampling) == reference
    assert generate(chunks, PROMPTS, new, topo=topo, sampling=sampling, cuda_graph=True) == reference
    assert generate(chunks, PROMPTS, new, topo=topo, sampling=sampling, cuda_graph=True, compile=True) == reference
    # a second call reuses nothing stale from the first one's graph
    assert generate(chunks, PROMPTS[:2], 7, topo=topo, sampling=sampling, cuda_graph=True) == \
        generate(chunks, PROMPTS[:2], 7, topo=topo, sampling=sampling, use_cache=False)
