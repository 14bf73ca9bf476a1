"""Data parallelism under CUDA-graphed and fused layers: the fused weight gradients a replayed graph
leaves, frozen inputs, and the capture lifting the gather hooks and putting them back."""

from __future__ import annotations


import pytest
import torch

from tessera.testing import run_ranks
from tessera.topology import Topology
from training_runs import GLOBAL, SEQ, STEPS, train_run



def _replay_graphs_of_fused_layers(stage, data_parallel, launched: list) -> None:
    """What train.cuda_graphs does with fused weight gradients, without CUDA: the capture's
    warm-up (a forward and autograd.grad to the input, inside ``capture_fused``), then every
    layer called through ``after_backward`` with ``graphed_backward_done`` for its fused weights.
    A replay runs only kernels; here the eager backward runs, and its ``accumulate_product``
    for a weight in ``graph_fused`` does only what the replay does: the GEMM into main_grad.
    ``launched`` gets, per step, whether every bucket's reduction had started when backward ended."""
    from tessera.training.cuda_graphs import fused_backward_done, replay

    for chunk in stage.chunks:
        layers = list(chunk.layers.values())
        x = torch.randn(SEQ, 1, chunk.cfg.hidden, requires_grad=True)
        assert all(len(layer._forward_pre_hooks) == 1 for layer in layers), "zero=1 at dp=2: gather waits"
        # graph_layers' capture: make_graphed_callables refuses modules with hooks, and its
        # warm-up is a forward and autograd.grad to the input, unused allowed
        with data_parallel.gather_hooks_lifted(layers), data_parallel.capture_fused():
            for layer in layers:
                assert not layer._forward_pre_hooks, "a gather hook left on a layer being captured"
                params = [p for p in layer.parameters() if p.requires_grad]
                grads = torch.autograd.grad(layer(x).sum(), [x, *params], allow_unused=True)
                assert sum(g is None for g in grads) == 4, "qkv, proj, fc1, fc2: no autograd gradient"
        for layer in layers:
            assert sum(p in data_parallel.graph_fused for p in layer.parameters()) == 4
            # the eager block stands in for the graphed one, in graph_layers' own replay
            layer.use_graph(replay(layer.block, x.shape, x.dtype, fused_backward_done(layer, data_parallel)))
    finish = data_parallel.finish_grad_sync
    data_parallel.finish_grad_sync = lambda: (launched.append(all(st.launched for st in data_parallel._states)),
                                              finish())[1]


def _graphed_fused_worker(rank: int, world: int) -> dict:
    topo = Topology.build()
    sets = ["parallel.zero=1", "train.grad_accum_fusion=true"]
    eager = train_run(topo, sets)
    launched = []
    graphed = train_run(topo, sets, prepare=lambda stage, dp: _replay_graphs_of_fused_layers(stage, dp, launched))
    try:
        train_run(topo, ["parallel.zero=2", "train.grad_accum_fusion=true"],
                  prepare=lambda stage, dp: _replay_graphs_of_fused_layers(stage, dp, []))
        refused = ""
    except ValueError as e:
        refused = str(e)
    return dict(eager=eager, graphed=graphed, launched=launched, refused=refused)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fused_weight_gradients_replayed_by_graphs_match_eager_fusion():
    """train.cuda_graphs with fused weight gradients, replayed without CUDA at dp=2 zero=1: the
    same losses and parameters as eager fusion (the buffers zeroed at each step's start, every
    replayed GEMM adding), the arrivals reported after each layer's backward start the bucket
    reductions during backward, zero=2 (buffers that come and go) is refused, and the layers'
    gather-waiting hooks, lifted for the capture, wait for the same buckets after it."""
    for r, out in enumerate(run_ranks(_graphed_fused_worker, 2, timeout=240)):
        a, b = out["eager"], out["graphed"]
        assert a["fused_calls"] == 8 * (GLOBAL // 2) * STEPS
        assert b["losses"] == a["losses"] and b["norms"] == a["norms"], (b["losses"], a["losses"])
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=0, atol=0, msg=name)
        assert out["launched"] == [True] * STEPS, out["launched"]
        assert "zero 0 or 1, not zero=2" in out["refused"], out["refused"]
        # the gather hooks lifted for the capture came back: every layer waits for its buckets
        assert a["waited"] and b["waited"] == a["waited"], (b["waited"], a["waited"])


def _freeze_embeddings(chunks) -> None:
    for chunk in chunks:
        for p in chunk.embedding.parameters():
            p.requires_grad_(False)
        chunk.pos_embedding.weight.requires_grad_(False)


def _frozen_embedding_graphed_worker(rank: int, world: int) -> dict:
    topo = Topology.build()
    sets = ["parallel.zero=1", "train.grad_accum_fusion=true"]
    eager = train_run(topo, sets, setup=_freeze_embeddings)
    launched = []
    graphed = train_run(topo, sets, setup=_freeze_embeddings,
                        prepare=lambda stage, dp: _replay_graphs_of_fused_layers(stage, dp, launched))
    return dict(eager=eager, graphed=graphed, launched=launched)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_graphed_fused_layer_whose_input_needs_no_gradient_still_reports_its_weights():
    """A frozen embedding: the first graphed layer's input needs no gradient, yet its replayed
    backward adds its fused weight gradients into main_grad. Their arrival must still be
    reported after the replay (else they counted nothing, their bucket started only after
    backward and finish_grad_sync cleared them as gradients that never came): training equals
    eager fusion's."""
    for out in run_ranks(_frozen_embedding_graphed_worker, 2, timeout=240):
        a, b = out["eager"], out["graphed"]
        assert out["launched"] == [True] * STEPS, out["launched"]
        assert b["losses"] == a["losses"] and b["norms"] == a["norms"], (b["norms"], a["norms"])
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=0, atol=0, msg=name)


def _lift_during_capture(stage, data_parallel, fused: bool, record: list) -> None:
    """cuda_graphs.capture on each chunk's layers with make_graphed_callables stubbed (no CUDA
    here): record whether the stub saw the layers without hooks (as make_graphed_callables
    requires), with unused inputs allowed and the fused GEMMs being captured exactly when
    ``fused``, and whether the hooks were back after it returned and after it raised."""
    from tessera.training import cuda_graphs

    real = torch.cuda.make_graphed_callables

    def stub(callables, samples, num_warmup_iters, allow_unused_input, fail=False):
        record.append(("captured", all(not m._forward_pre_hooks for m in callables), allow_unused_input,
                       data_parallel._capturing))
        if fail:
            raise RuntimeError("capture failed")

    try:
        for chunk in stage.chunks:
            layers = list(chunk.layers.values())
            samples = tuple((torch.randn(SEQ, 1, chunk.cfg.hidden),) for _ in layers)
            record.append(("hooked before", all(len(m._forward_pre_hooks) == 1 for m in layers)))
            torch.cuda.make_graphed_callables = stub
            cuda_graphs.capture(layers, samples, 1, data_parallel, fused)
            record.append(("hooked after", all(len(m._forward_pre_hooks) == 1 for m in layers)))
            torch.cuda.make_graphed_callables = lambda *a, **k: stub(*a, **k, fail=True)
            try:
                cuda_graphs.capture(layers, samples, 1, data_parallel, fused)
            except RuntimeError as e:
                record.append(("raised", str(e)))
            record.append(("hooked after a failure", all(len(m._forward_pre_hooks) == 1 for m in layers)))
    finally:
        torch.cuda.make_graphed_callables = real


def _capture_lift_worker(rank: int, world: int) -> dict:
    topo = Topology.build()
    out = {}
    for name, sets, fused in (("zero1", ["parallel.zero=1"], False),
                              ("zero1-fused", ["parallel.zero=1", "train.grad_accum_fusion=true"], True),
                              ("zero2", ["parallel.zero=2"], False)):
        record = []
        lifted = train_run(topo, sets, prepare=lambda stage, dp: _lift_during_capture(stage, dp, fused, record))
        out[name] = dict(record=record, lifted=lifted, plain=train_run(topo, sets), fused=fused)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_capture_lifts_the_gather_hooks_and_puts_them_back():
    """cuda_graphs.capture at dp=2 under zero 1/2's overlapped gather: make_graphed_callables
    sees the layers without their gather hooks, the hooks are back after the capture and after a
    failed one, the fused GEMMs are captured only when asked, and training afterwards waits for
    the same buckets and gives the same losses as without the capture."""
    for out in run_ranks(_capture_lift_worker, 2, timeout=240):
        for name, run in out.items():
            fused = run["fused"]
            assert run["record"] == [("hooked before", True), ("captured", True, fused, fused), ("hooked after", True),
                                     ("captured", True, fused, fused), ("raised", "capture failed"),
                                     ("hooked after a failure", True)], (name, run["record"])
            a, b = run["plain"], run["lifted"]
            assert a["waited"] and b["waited"] == a["waited"], name
            assert b["losses"] == a["losses"] and b["norms"] == a["norms"], name
