"""Per-layer CUDA graphs' bookkeeping without CUDA: what a graphed layer refuses to replay, the
graphs freed exactly once (also after a failed capture or a failed device sync), and the fused
weights given back to eager counting. The captures themselves run in tests/test_gpu.py."""

import pytest
import torch


def _layer():
    from tessera.config import ModelConfig
    from tessera.models.transformer import TPContext, TransformerLayer
    layer = TransformerLayer(ModelConfig(hidden=8, heads=2), TPContext())
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
    return layer


def test_graphed_layer_call_refuses_what_its_graph_cannot_replay():
    """A graphed layer's replay (no CUDA needed to check it): in training the model's empty
    PackedSequence passes, packed positions and another input shape or dtype are refused (the
    graph would broadcast or cast into its static input); eval runs the layer's own block."""
    from tessera.models.packed import PackedSequence
    from tessera.training.cuda_graphs import replay

    layer, calls = _layer(), []
    layer.use_graph(replay(lambda x: calls.append(x) or 2 * x, torch.Size([4, 2, 8]), torch.float32))
    x = torch.ones(4, 2, 8)
    assert torch.equal(layer(x, PackedSequence()), 2 * x) and torch.equal(layer(x), 2 * x) and len(calls) == 2
    packed = PackedSequence(position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="unpacked sequences only"):
        layer(x, packed)
    with pytest.raises(ValueError, match=r"captured for \(4, 2, 8\) torch.float32 inputs, got \(4, 1, 8\)"):
        layer(torch.ones(4, 1, 8))
    with pytest.raises(ValueError, match="got \\(4, 2, 8\\) torch.bfloat16"):
        layer(x.bfloat16())
    layer.eval()  # the layer's own block, packed sequences and any shape included
    assert torch.equal(layer(torch.ones(3, 1, 8)), layer.block(torch.ones(3, 1, 8)))
    assert torch.equal(layer(x, packed), layer.block(x, packed)) and len(calls) == 2


def test_released_layer_graphs_restore_the_eager_block_and_free_each_graph_once():
    """LayerGraphs.release (run by the trainer before the process group goes: a live graph with
    captured NCCL work hangs destroy_process_group) gives the layer its own block back and resets
    every graph it was given, once."""
    from tessera.training.cuda_graphs import LayerGraphs, replay

    class Graph:
        resets = 0

        def reset(self):
            self.resets += 1

    layer, graphs = _layer(), [Graph(), Graph()]
    layer.use_graph(replay(lambda x: 2 * x, torch.Size([4, 2, 8]), torch.float32))
    with pytest.raises(ValueError, match="captured for"):
        layer(torch.ones(3, 2, 8))
    handle = LayerGraphs([layer], graphs)
    handle.release()
    handle.release()
    assert [g.resets for g in graphs] == [1, 1]
    assert layer.graph is None and torch.equal(layer(torch.ones(3, 2, 8)), layer.block(torch.ones(3, 2, 8)))


def test_layer_graphs_are_freed_even_when_the_device_sync_fails(monkeypatch):
    """A sticky CUDA error in release's synchronize must not leave the graphs alive."""
    from tessera.training.cuda_graphs import LayerGraphs

    class Graph:
        resets = 0

        def reset(self):
            self.resets += 1

    def failing_sync():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", failing_sync)
    graphs = [Graph(), Graph()]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        LayerGraphs([], graphs).release()
    assert [g.resets for g in graphs] == [1, 1]


def test_released_graphs_give_their_fused_weights_back_to_eager_counting():
    """After LayerGraphs.release (end of training, a failed capture) the layers' weights leave
    DataParallel.graph_fused: an eager backward must count their gradients again."""
    import types

    from tessera.training.cuda_graphs import LayerGraphs

    layer, other = _layer(), torch.nn.Linear(2, 2)
    dp = types.SimpleNamespace(graph_fused={*layer.parameters(), other.weight})
    LayerGraphs([layer], [], dp).release()
    assert dp.graph_fused == {other.weight}


def test_graph_stage_releases_what_it_captured_when_a_later_chunk_fails(monkeypatch):
    """A capture that fails part-way frees the graphs already taken (they would hang the
    process group's destruction) and raises."""
    from tessera.config import load_config
    from tessera.training import cuda_graphs

    released = []

    class Taken:
        def release(self):
            released.append(self)

    calls = []

    def capture(chunk, micro_batch, seq_len, data_parallel=None, fused=False):
        calls.append((micro_batch, seq_len))
        if len(calls) == 2:
            raise RuntimeError("capture failed")
        return Taken()

    monkeypatch.setattr(cuda_graphs, "graph_layers", capture)
    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=64",
                             "train.micro_batch=2"])
    with pytest.raises(RuntimeError, match="capture failed"):
        cuda_graphs.graph_stage(["chunk0", "chunk1"], cfg)
    assert calls == [(2, 32), (2, 32)] and len(released) == 1  # per-rank sequence under SP
