"""Data parallelism and ZeRO against the single-rank model (issue 4).

Every run trains the same tiny GPT for 5 steps on the same global batch, whose micro-batches
hold different numbers of valid tokens, with clipping on. dp in {1, 2, 4} x zero in {0, 1, 2, 3},
and tp=2 x pp=2 x dp=2 on 8 processes, must give the losses, gradient norms and parameters of
dp=1 / zero=0. One ``run_ranks`` call per world size; each worker loops over its runs.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from parity import assert_close, assert_same_params, assert_same_training, compare_to_full, param_kind, tp_close
from tessera.config import load_config
from tessera.distributed.memory import bytes_per_parameter, memory_report
from tessera.models import GPTModel
from tessera.optim import DynamicLossScaler
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.build import build, build_chunks
from tessera.training.plan import make_plan
from tessera.training.preflight import validate
from tessera.training.step import train_step
from training_runs import BASE, GLOBAL, SEQ, STEPS, VOCAB, my_micro_batches, train_run


def _dp_worker(rank: int, world: int, runs: list[tuple[str, int, int, list[str]]]) -> dict:
    out = {}
    for name, tp, pp, overrides in runs:
        out[name] = train_run(Topology.build(tp=tp, pp=pp), [f"parallel.tp={tp}", f"parallel.pp={pp}", *overrides])
    return out


ZEROS = [f"parallel.zero={z}" for z in range(4)]
# optim.eps: the key-bias gradient is zero in exact arithmetic (softmax ignores it), so it is pure
# rounding noise that a tiny eps would turn into full-size, layout-dependent Adam steps.
RUNS = {
    1: [(f"zero{z}", 1, 1, [ZEROS[z]]) for z in range(4)],
    2: [(f"zero{z}", 1, 1, [ZEROS[z]]) for z in range(4)]
       + [("zero1-no-overlap", 1, 1, [ZEROS[1], "parallel.overlap_grad_reduce=false",
                                      "parallel.overlap_param_gather=false"]),
          ("zero2-no-overlap", 1, 1, [ZEROS[2], "parallel.overlap_grad_reduce=false"]),
          ("zero1-bf16", 1, 1, [ZEROS[1], "train.dtype=bf16"]),
          ("zero0-bf16", 1, 1, [ZEROS[0], "train.dtype=bf16"]),
          ("zero1-bf16-bf16grads", 1, 1, [ZEROS[1], "train.dtype=bf16", "train.grad_dtype=bf16"]),
          ("zero2-bf16-bf16grads", 1, 1, [ZEROS[2], "train.dtype=bf16", "train.grad_dtype=bf16"]),
]
       + [(f"zero{z}-fused", 1, 1, [ZEROS[z], "train.grad_accum_fusion=true"]) for z in range(3)]
       + [("zero1-fused-compiled", 1, 1, [ZEROS[1], "train.grad_accum_fusion=true", "train.compile=true"])]
       + [(f"pp2-zero{z}", 1, 2, [ZEROS[z]]) for z in (0, 1)]
       + [("pp2-zero0-no-overlap", 1, 2, [ZEROS[0], "parallel.overlap_grad_reduce=false"]),
          ("pp2-zero1-1f1b", 1, 2, [ZEROS[1], "parallel.schedule=1f1b"])],
    4: [(f"zero{z}", 1, 1, [ZEROS[z]]) for z in range(4)]
       # interleaved-zb (vpp=2; the 2 layers on the middle virtual stages) at dp=2: its W's of
       # different chunks interleave in the buckets; with and without fused weight gradients
       + [(f"izb-zero{z}{'-fused' if fused else ''}", 1, 2,
           [ZEROS[z], "parallel.vpp=2", "parallel.schedule=interleaved-zb", "parallel.pp_layout=0,1,1,0",
            f"train.grad_accum_fusion={str(fused).lower()}"]) for z, fused in ((0, False), (1, True))]
       # whole compiled layers: their W's filed by tessera's opaque ops, run by the schedule
       + [("izb-zero1-compiled", 1, 2, [ZEROS[1], "parallel.vpp=2", "parallel.schedule=interleaved-zb",
                                        "parallel.pp_layout=0,1,1,0", "train.compile=true"])],
    8: [(f"zero{z}", 2, 2, [ZEROS[z], "parallel.sequence_parallel=true"]) for z in range(4)]
       + [("zero1-fused", 2, 2, [ZEROS[1], "parallel.sequence_parallel=true", "train.grad_accum_fusion=true",
                                 "parallel.tp_comm_overlap=true"])],
}


@functools.cache
def results(world: int) -> list[dict]:
    return run_ranks(_dp_worker, world, RUNS[world], timeout=400)


def reference() -> dict:
    return results(1)[0]["zero0"]


def test_reference_trains():
    ref = reference()
    assert ref["losses"][-1] < ref["losses"][0]
    assert all(n > 0.5 for n in ref["norms"][:2]), "clipping must be active for the norm to matter"
    start = GPTModel(load_config(None, BASE).model)
    start.init_weights(7)
    moved = [name for name, p in start.named_parameters() if not torch.allclose(p, ref["params"][name])]
    assert len(moved) == len(ref["params"]), "every parameter must have moved in 5 steps"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, *(pytest.param(w, marks=pytest.mark.slow) for w in (2, 4))])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_and_zero_match_one_rank(world, zero):
    ref = reference()
    for r, out in enumerate(results(world)):
        run = out[f"zero{zero}"]
        assert_same_training(run, ref, f"dp={world} zero={zero} rank {r}")
        assert_same_params(run["params"], ref, f"dp={world} zero={zero} rank {r}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_with_tp2_pp2_dp2(zero):
    ref = reference()
    ranks = [out[f"zero{zero}"] for out in results(8)]
    assert ranks[0]["schedule"] == ("1f1b" if zero >= 2 else "zb-h1")  # ZB's deferred W goes through the buckets
    last = [r for r in ranks if r["pp_rank"] == 1]
    for r in last:
        assert_same_training(r, ref, f"tp2 pp2 dp2 zero={zero} rank tp{r['tp_rank']} dp{r['dp_rank']}", rel=1e-4)
    model = GPTModel(load_config(None, BASE).model)  # for the kinds of the parameters
    for pp_rank in (0, 1):
        for dp_rank in (0, 1):
            shards = sorted((r for r in ranks if r["pp_rank"] == pp_rank and r["dp_rank"] == dp_rank),
                            key=lambda r: r["tp_rank"])
            for name in shards[0]["params"]:
                source = "embedding.weight" if name == "output.weight" else name  # the tied copy
                kind, sizes = param_kind(model, source) if name != "output.weight" else ("vocab", None)
                compare_to_full(kind, sizes, [s["params"][name] for s in shards], ref["params"][source],
                                f"zero={zero} pp{pp_rank} dp{dp_rank} {name}", VOCAB, check=tp_close)


def assert_pipeline_run_matches(run: dict, ref: dict, what: str, check=None) -> None:
    """A pp=2 rank's run against one rank: losses and norms (on the last stage, which holds the
    loss) and every parameter (the last stage's tied output layer against the embedding)."""
    if run["pp_rank"] == 1:
        assert_same_training(run, ref, what, rel=1e-5)
    for pname, p in run["params"].items():
        source = "embedding.weight" if pname == "output.weight" else pname
        (check or assert_close)(p, ref["params"][source], f"{what}: {pname}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["izb-zero0", "izb-zero1-fused", "izb-zero1-compiled"])
def test_interleaved_zb_at_dp2_matches_one_rank(name):
    """pp=2 x dp=2 under interleaved-zb: the same losses, norms and parameters as one rank."""
    ref = reference()
    for r in results(4):
        run = r[name]
        assert run["schedule"] == "interleaved-zb"
        # (compiled layers fuse differently: one element of 4096 off by 1.8e-6 after 5 steps)
        assert_pipeline_run_matches(run, ref, f"{name} pp rank {run['pp_rank']} dp rank {run['dp_rank']}",
                                    check=tp_close if name.endswith("compiled") else None)
    assert any(r[name]["fused_calls"] for r in results(4)) == name.endswith("fused")
    if name.endswith("compiled"):  # the deferred W's through the opaque ops: one graph per layer
        assert all(r[name]["graph_breaks"] == 0 for r in results(4))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["pp2-zero0", "pp2-zero1", "pp2-zero0-no-overlap", "pp2-zero1-1f1b"])
def test_tied_embedding_sum_overlaps_backward_at_pp2(name):
    """pp=2 (ZB-H1, dp=1): the two copies of the tied embedding are summed over the embedding
    group by DataParallel once the pipeline's messages are issued, on the first stage while its
    last weight gradients still run, and training matches one rank. Without overlap the sum
    runs after backward (in finish_grad_sync), with the same result. Under 1F1B the last
    stage's copy is final during its last B, before that B's gradient is sent: the sum still
    waits for the send (issued earlier on one rank than a message on the other, NCCL could
    hang)."""
    ref = reference()
    ranks = results(2)
    for r in ranks:
        run = r[name]
        assert run["schedule"] == ("1f1b" if name.endswith("1f1b") else "zb-h1")
        what = f"{name} pp rank {run['pp_rank']}"
        assert_pipeline_run_matches(run, ref, what)
        assert run["tied_by_dp"], what
        # per step: every pipeline message issued before the sum (p: a send or receive, s: a sum)
        for step, seq in enumerate(run["order"]):
            assert seq.count("s") == 1 and seq.endswith("s") and "p" in seq, (what, step, seq)
    first = ranks[0][name] if ranks[0][name]["pp_rank"] == 0 else ranks[1][name]
    if name.endswith("1f1b"):
        return
    if name != "pp2-zero0-no-overlap":
        assert first["w_after_tied"] >= STEPS, f"{name}: the first stage's last W's ran before the tied sum started"
    else:
        assert first["w_after_tied"] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grad_accum_fusion_matches_one_rank():
    """Weight gradients added straight into the buckets (train.grad_accum_fusion) at dp=2 for zero
    0-2, and at tp2 x pp2 x dp2 with ZB-H1 (whose deferred W GEMMs take the same route), there
    with the TP communication overlap on too."""
    ref = reference()
    for r, out in enumerate(results(2)):
        for zero in range(3):
            run = out[f"zero{zero}-fused"]
            # qkv, proj, fc1, fc2 of 2 layers (the tied output layer is left to autograd), every
            # micro-batch of every step: the trainer wired the fusion in
            assert run["fused_calls"] == 8 * (GLOBAL // 2) * STEPS, run["fused_calls"]
            assert out[f"zero{zero}"]["fused_calls"] == 0
            assert_same_training(run, ref, f"fused dp=2 zero={zero} rank {r}")
            assert_same_params(run["params"], ref, f"fused dp=2 zero={zero} rank {r}")
        # compiled layers: the linear layers run eagerly between the compiled pieces, still fused;
        # inductor's fused elementwise kernels round differently (like tp=2's split sums)
        run = out["zero1-fused-compiled"]
        assert run["fused_calls"] == 8 * (GLOBAL // 2) * STEPS, run["fused_calls"]
        assert_same_training(run, ref, f"fused compiled dp=2 rank {r}")
        assert_same_params(run["params"], ref, f"fused compiled dp=2 rank {r}", check=tp_close)
    ranks = [out["zero1-fused"] for out in results(8)]
    assert ranks[0]["schedule"] == "zb-h1"
    assert all(r["fused_calls"] > 0 for r in ranks)
    for r in (r for r in ranks if r["pp_rank"] == 1):
        assert_same_training(r, ref, f"fused tp2 pp2 dp2 rank tp{r['tp_rank']} dp{r['dp_rank']}", rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_overlap_on_and_off_are_identical():
    for out in results(2):
        for zero in (1, 2):
            on, off = out[f"zero{zero}"], out[f"zero{zero}-no-overlap"]
            assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
            for name in on["params"]:
                assert torch.equal(on["params"][name], off["params"][name]), name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_param_gathers_start_after_the_update_in_the_order_the_forward_waits():
    """zero 1/2: one optimizer update, then every bucket's all-gather; the gathers start in the
    order the next forward first waits for the buckets (pp=2, vpp=2: two model chunks per rank,
    one buffer each, with fused weight gradients)."""
    for out in results(2):
        for name in ("zero1", "zero2", "zero1-bf16"):
            n = out[name]["ranges"]
            assert n >= 3, "the test model should have several buckets"
            assert out[name]["opt_events"] == ["S", f"G{n}"] * STEPS, out[name]["opt_events"][:4]
    for r in results(4):
        b = r["izb-zero1-fused"]
        assert b["opt_events"] == ["S", f"G{b['ranges']}"] * STEPS, b["opt_events"][:4]
        # every step's gathers start in the order the next step's forward waits for the buckets
        assert len(b["waited"]) == b["ranges"] * (STEPS - 1), (b["waited"], b["ranges"])
        assert b["waited"] == b["gathered"][:len(b["waited"])], (b["gathered"][:b["ranges"]], b["waited"][:b["ranges"]])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_trains_close_to_fp32():
    ref = reference()
    for out in results(2):
        for name in ("zero0-bf16", "zero1-bf16", "zero1-bf16-bf16grads", "zero2-bf16-bf16grads"):
            run = out[name]
            assert run["losses"][-1] < run["losses"][0], name
            for a, b in zip(ref["losses"], run["losses"]):
                assert b == pytest.approx(a, rel=3e-2), (name, a, b)
            for p, q in zip(run["params"].values(), ref["params"].values()):
                assert (p - q).abs().max() < 0.05, name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_model_state_bytes_follow_zero():
    by_world = {w: results(w)[0] for w in (1, 2, 4)}
    numel = by_world[1]["zero0"]["memory"].numel
    for zero in (1, 2, 3):
        one = by_world[1][f"zero{zero}"]["state_bytes"]
        assert one == pytest.approx(8 * numel, rel=0.05), "Adam's two fp32 moments"
        for world in (2, 4):
            state = by_world[world][f"zero{zero}"]["state_bytes"]
            assert state == pytest.approx(one / world, rel=0.1), (zero, world, state, one)
    replicated = by_world[4]["zero0"]["state_bytes"]
    assert replicated == by_world[1]["zero0"]["state_bytes"], "zero=0 keeps the whole optimizer on every rank"
    for world in (1, 2, 4):  # measured totals against the table (fp32 model: no main-param copy)
        for zero in range(4):
            report = by_world[world][f"zero{zero}"]["memory"]
            assert report.total / numel == pytest.approx(bytes_per_parameter(zero, world, "fp32"), rel=0.1), \
                (world, zero, str(report))
    bf16 = results(2)[0]["zero1-bf16-bf16grads"]["memory"]
    assert bf16.total / numel == pytest.approx(bytes_per_parameter(1, 2, "bf16", "bf16"), rel=0.1), str(bf16)


def test_megatron_table():
    assert bytes_per_parameter(0, 8) == 18
    for dp in (1, 2, 8, 64):
        assert bytes_per_parameter(1, dp) == 6 + 12 / dp
        assert bytes_per_parameter(2, dp) == 2 + 16 / dp
        assert bytes_per_parameter(3, dp) == 16 / dp


def _overflow_worker(rank: int, world: int) -> dict:
    """dp=2, zero=1, fp16: dp rank 1 alone overflows at step 3 (an inf in its activations)."""
    topo = Topology.build()
    scaler = DynamicLossScaler(init_scale=2.0**8)
    seen = {}

    def inject(step, stage):
        if step == 2 and topo.dp_rank == 1:
            h = stage.chunks[0].final_norm.register_forward_hook(lambda m, i, o: o * float("inf"))
            seen["handle"] = h
        elif "handle" in seen:
            seen.pop("handle").remove()

    run = train_run(topo, ["parallel.zero=1", "train.dtype=fp16"], scaler=scaler, hook=inject)
    run["scale"] = scaler.scale
    return run


@pytest.mark.timeout(300)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    out = run_ranks(_overflow_worker, 2, timeout=240)
    for run in out:
        assert run["skipped"] == [False, False, True, False, False], run["skipped"]
        assert run["scale"] == 2.0**7
        assert math.isnan(run["norms"][2]) and all(math.isfinite(n) for i, n in enumerate(run["norms"]) if i != 2)
    for name in out[0]["params"]:
        assert torch.equal(out[0]["params"][name], out[1]["params"][name]), f"replicas diverged: {name}"


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


def test_parameter_without_gradient_this_step_reduces_zeros():
    """The buffer is not zeroed between steps (a step's first gradient is copied in), so a
    parameter that gets no gradient in a step must be cleared before its bucket is reduced."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel

    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    dp = DataParallel([model], Topology.build(), bucket_size=10**6)
    x = torch.randn(3, 4)
    dp.start_step(2)
    for _ in range(2):
        (model["a"](x).sum() + model["b"](x).square().sum()).backward()
    dp.finish_grad_sync()
    assert model["b"].weight.main_grad.abs().sum() > 0
    dp.start_step(1)
    model["a"](x).sum().backward()
    dp.finish_grad_sync()
    assert torch.count_nonzero(model["b"].weight.main_grad) == 0 and torch.count_nonzero(model["b"].bias.main_grad) == 0
    torch.testing.assert_close(model["a"].weight.main_grad, x.sum(0).expand(4, 4))


def test_a_chunk_without_trainable_parameters_is_accepted():
    """A chunk whose parameters are all frozen (or that has none) gets an empty buffer, and the
    frozen parameters take the model's dtype with the trainable ones."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel

    frozen, live = nn.Linear(4, 4), nn.Linear(4, 4)
    frozen.requires_grad_(False)
    dp = DataParallel([nn.ModuleDict({"f": frozen}), nn.ModuleDict({"l": live})], Topology.build(),
                      param_dtype=torch.float64, bucket_size=10**6)
    assert frozen.weight.dtype == torch.float64 and live.weight.dtype == torch.float64
    assert not hasattr(frozen.weight, "main_grad")
    x = torch.randn(3, 4, dtype=torch.float64)
    dp.start_step(1)
    live(frozen(x)).sum().backward()
    dp.finish_grad_sync()
    torch.testing.assert_close(live.bias.main_grad, torch.full((4,), 3.0))  # fp32 main grads


def test_wrapping_a_wrapped_model_again_is_refused_until_removed():
    """A second DataParallel over the same parameters would run both one's hooks: the first takes
    each gradient, the second sees none. It is refused, and allowed after ``remove()``, which
    leaves the first with no hooks (its buffers no longer see gradients)."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel

    model = nn.ModuleDict({"a": nn.Linear(4, 4)})
    first = DataParallel([model], Topology.build(), bucket_size=10**6)
    with pytest.raises(ValueError, match=r"a\.weight is already managed by a DataParallel.*remove\(\)"):
        DataParallel([model], Topology.build(), bucket_size=10**6)
    first.remove()
    second = DataParallel([model], Topology.build(), bucket_size=10**6)
    x = torch.randn(3, 4)
    first.start_step(1)
    second.start_step(1)
    model["a"](x).sum().backward()
    second.finish_grad_sync()
    torch.testing.assert_close(model["a"].weight.main_grad, x.sum(0).expand(4, 4))
    assert torch.count_nonzero(first.buffers[0].grad_data) == 0 and model["a"].weight.grad is None


def test_a_weight_grad_store_sends_to_the_sink_it_was_built_with():
    """A store whose sink is a DataParallel fuses the weight gradient into its main gradient (and
    counts the arrival); once that DataParallel is removed, the model takes a new store, and one
    without a sink sends to ``param.grad``. Fusion without a sink is refused."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel
    from tessera.tensor_parallel.wgrad import WeightGradStore, linear

    with pytest.raises(ValueError, match="give the sink"):
        WeightGradStore(fuse=True)
    weight = nn.Parameter(torch.randn(4, 3))
    dp = DataParallel([nn.ParameterDict({"w": weight})], Topology.build(), bucket_size=1)
    x = torch.randn(2, 3)
    dp.start_step(1)
    linear(x, weight, None, WeightGradStore(sink=dp, fuse=True)).sum().backward()
    assert weight.grad is None and dp._count[weight] == 1
    torch.testing.assert_close(weight.main_grad, torch.ones(2, 4).t() @ x)
    dp.finish_grad_sync()
    dp.remove()
    linear(x, weight, None, WeightGradStore()).sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones(2, 4).t() @ x)


def _module_list_worker(rank: int, world: int) -> dict:
    """zero=1 with the overlapped parameter gather over a chunk whose ``layers`` is a ModuleList."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel

    torch.manual_seed(0)
    chunk = nn.Module()
    chunk.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
    dp = DataParallel([chunk], Topology.build(), zero=1, bucket_size=1)
    waits = [len(buckets) for module, buckets, _ in dp._gather_hooks if module in list(chunk.layers)]
    return {"waits": waits}


@pytest.mark.timeout(120)
def test_layers_as_a_module_list_get_gather_waits():
    out = run_ranks(_module_list_worker, 2, timeout=60)
    assert out[0]["waits"] == [2, 2]  # each layer waits for its weight's and its bias's bucket


def _uneven_worker(rank: int, world: int, zero: int) -> dict:
    """Rank 0 uses both linears, rank 1 only the second: bucket of ``a`` completes during backward
    on rank 0 and only in finish_grad_sync on rank 1. The reductions must still pair up."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
    dp = DataParallel([model], Topology.build(), zero=zero, bucket_size=1)  # one bucket per parameter
    x = torch.full((2, 8), float(rank + 1))
    dp.start_step(1)
    loss = model["b"](x).sum() + (model["a"](x).sum() if rank == 0 else 0.0)
    try:
        loss.backward()
        dp.finish_grad_sync()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"a": model["a"].weight.main_grad.clone(), "b": model["b"].weight.main_grad.clone()}


@pytest.mark.timeout(120)
def test_reductions_pair_up_when_a_bucket_completes_at_different_times():
    out = run_ranks(_uneven_worker, 2, 0, timeout=60)
    for name, per_rank in (("a", 2.0), ("b", 2.0 + 4.0)):  # d/dW of sum(W x) = sum over the batch of x
        for r in out:
            torch.testing.assert_close(r[name], torch.full((8, 8), per_rank), msg=name)


def _uneven_chunks_worker(rank: int, world: int, zero: int) -> dict:
    """Two model chunks (as a virtual pipeline holds), one bucket per weight, all of one size:
    rank 0 uses every weight, rank 1 not chunk 1's ``b``, whose bucket (its chunk's first in
    backward order) then completes during backward on rank 0 only. Ordered per chunk, rank 1
    would reduce chunk 0's bucket first while rank 0 reduces chunk 1's: the sums would pair
    different weights. Each rank returns each weight's reduced gradient (its shard's part at zero=1)."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel

    chunks = [nn.ModuleDict({k: nn.Linear(16, 16, bias=False) for k in "ab"}) for _ in range(2)]
    dp = DataParallel(chunks, Topology.build(), zero=zero, bucket_size=1)
    x = torch.full((2, 16), float(rank + 1))
    dp.start_step(1)
    loss = chunks[0]["a"](x).sum() + chunks[0]["b"](x).sum() + chunks[1]["a"](x).sum()
    if rank == 0:
        loss = loss + chunks[1]["b"](x).sum()
    loss.backward()  # (chunk 1's gradients first: autograd runs the later-made nodes first)
    dp.finish_grad_sync()
    names = {m.weight: f"{c}{k}" for c, chunk in enumerate(chunks) for k, m in chunk.items()}
    return {names[param]: rng.grad[a:b].clone() for rng in dp.ranges for param, a, b in rng.fragments}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 1])
def test_reductions_pair_up_across_model_chunks(zero):
    """dp=2 with two model chunks per rank and a weight without a gradient on one rank: the
    buckets are reduced in one order over all chunks, the same on every rank, so each weight's
    gradient is the sum of its own (d/dW of sum(W x) = the batch's sum of x: 2 on rank 0, 4 on
    rank 1; chunk 1's b only on rank 0)."""
    out = run_ranks(_uneven_chunks_worker, 2, zero, timeout=60)
    for r in out:
        assert sorted(r) == ["0a", "0b", "1a", "1b"]
        for name, grad in r.items():
            want = 2.0 if name == "1b" else 6.0
            torch.testing.assert_close(grad, torch.full_like(grad, want), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(120)
def test_zero2_refuses_parameters_without_gradients():
    out = run_ranks(_uneven_worker, 2, 2, timeout=60)
    assert "zero=2 needs every parameter" in out[1]["error"]


def test_zero2_and_zero_bubble_refused():
    from tessera.config import ConfigError

    with pytest.raises(ConfigError, match="zb-h1 holds every zero=2"):
        validate(load_config(None, ["parallel.zero=2", "parallel.pp=2", "parallel.schedule=zb-h1"]), 2)


@pytest.mark.parametrize("args,problem", [
    ((0, 2, "float32"), "dtype must be one of fp32, bf16, fp16, not 'float32'"),
    ((0, 2, "bf16", "half"), "grad_dtype must be one of"),
    ((1, 0), "dp is a number of data-parallel ranks >= 1, not 0"),
    ((2, -2), "not -2"),
])
def test_memory_table_refuses_bad_input(args, problem):
    with pytest.raises(ValueError, match=problem):
        bytes_per_parameter(*args)


def _frozen_memory_worker(rank: int, world: int, zero: int) -> tuple[int, int, int]:
    topo = Topology.build()
    cfg = validate(load_config(None, BASE + [f"parallel.zero={zero}"]), world)
    plan = make_plan(cfg, topo.device)
    chunks = build_chunks(cfg, topo, plan, RNGTracker.for_rank(cfg.train.seed, topo.tp_rank, topo.pp_rank))
    for chunk in chunks:
        chunk.embedding.weight.requires_grad_(False)
    parts = build(cfg, topo, plan, chunks=chunks)
    report = memory_report(parts.data_parallel, parts.optimizer)
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    return report.numel, trainable, report.grads


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_memory_report_counts_trainable_parameters_at_every_zero():
    """A frozen embedding has no gradient and is left out of the count, under FSDP as under
    zero 0-2 (zero=3's gradients: the fp32 shards of the trainable parameters)."""
    for zero in (1, 3):
        numel, trainable, grads = run_ranks(_frozen_memory_worker, 2, zero, timeout=60)[0]
        assert numel == trainable, zero
        if zero == 3:
            assert grads == trainable // 2 * 4


def test_bf16_gradients_table_counts_the_fp32_copy():
    assert bytes_per_parameter(0, 4, "bf16", "bf16") == 2 + 2 + 4 + 4 + 8
    assert bytes_per_parameter(1, 4, "bf16", "bf16") == 2 + 2 + (4 + 8 + 4) / 4


def _wire_bytes_worker(rank: int, world: int) -> dict:
    """Per zero: the dtypes of the tensors this rank handed to the collectives in a step of a
    bf16-gradient model."""
    import torch.distributed as dist
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel
    sent = []
    for name in ("all_reduce", "reduce_scatter_tensor", "all_to_all_single", "all_gather_into_tensor"):
        fn, sends = getattr(dist, name), 0 if name == "all_reduce" else 1  # the argument sent: all_reduce's only one, else the input
        setattr(dist, name, lambda *a, fn=fn, i=sends, **k: (sent.append(str(a[i].dtype)), fn(*a, **k))[1])
    out = {}
    for zero in (0, 1, 2):
        torch.manual_seed(0)
        model = nn.ModuleDict({k: nn.Linear(16, 16, bias=False) for k in "ab"})
        dp = DataParallel([model], Topology.build(), zero=zero, grad_dtype=torch.bfloat16, bucket_size=1)
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
        sent.clear()
        dp.start_step(1)
        model["b"](model["a"](x)).sum().backward()
        dp.finish_grad_sync()
        out[zero] = sorted(set(sent))
    return out


def test_bf16_gradients_travel_as_bf16():
    """bf16 gradient buffers are sent as they are (the collectives sum them in fp32 on arrival),
    never widened to fp32 on the wire (zero=0's all-gather of the summed shards included)."""
    for out in run_ranks(_wire_bytes_worker, 2, timeout=120):
        assert out == {0: ["torch.bfloat16"], 1: ["torch.bfloat16"], 2: ["torch.bfloat16"]}, out


def _aborted_step_worker(rank: int, world: int) -> dict:
    """Per zero: the gradients of a clean one-micro-batch step, and of the same step after a step
    that ended with an exception after its first of two micro-batches (every rank alike)."""
    from torch import nn

    from tessera.distributed.data_parallel import DataParallel
    out = {}
    for zero in (0, 1, 2):
        grads = []
        for abort_first in (False, True):
            torch.manual_seed(0)
            model = nn.ModuleDict({"a": nn.Linear(8, 8, bias=False), "b": nn.Linear(8, 8, bias=False)})
            dp = DataParallel([model], Topology.build(), zero=zero, bucket_size=1)
            x = torch.full((2, 8), float(rank + 1))
            if abort_first:
                dp.start_step(2)
                (model["b"](model["a"](x)).sum() * 7).backward()  # then the step is given up
            dp.start_step(1)
            model["b"](model["a"](x)).sum().backward()
            dp.finish_grad_sync()
            grads.append([r.grad.clone() for r in dp.ranges])
        out[zero] = max((c - a).abs().max().item() for c, a in zip(*grads))
    return out


def test_a_step_given_up_midway_leaves_nothing_in_the_next():
    """A step abandoned after some micro-batches (a caught OOM, a bad batch) leaves reductions in
    flight: the next step waits for them first, so its gradients are exactly a clean step's
    (zero=2 added the abandoned step's shard into the next one's)."""
    for out in run_ranks(_aborted_step_worker, 2, timeout=120):
        assert out == {0: 0.0, 1: 0.0, 2: 0.0}, out


def _resume_worker(rank: int, world: int, overrides: list[str]) -> dict:
    """4 steps straight against 2 steps, save (model and optimizer state dicts), a fresh build,
    load, 2 more steps."""
    import copy

    from torch.distributed.tensor import DTensor

    topo = Topology.build()

    def built():
        cfg = validate(load_config(None, BASE + overrides), world)
        parts = build(cfg, topo)
        return cfg, parts, parts.data_parallel, parts.optimizer

    def steps(cfg, stage, dp, opt, first, n):
        curve = []  # (loss, grad norm) per step
        for s in range(first, first + n):
            mbs = my_micro_batches(s, topo)
            r = train_step(opt, mbs, topo, stage.executor(len(mbs)), dp, clip_grad=cfg.optim.clip_grad)
            curve.append((r.loss, r.grad_norm))
        dp.wait_param_gather()
        return curve

    straight = built()
    straight_curve = steps(*straight, 0, 4)
    saved = built()
    curve = steps(*saved, 0, 2)
    model_state, opt_state = (copy.deepcopy(saved[1].model.state_dict()), copy.deepcopy(saved[3].state_dict()))
    resumed = built()
    resumed[1].model.load_state_dict(model_state)
    resumed[3].load_state_dict(opt_state)
    curve += steps(*resumed, 2, 2)
    full = lambda p: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
    a, b = dict(straight[1].model.named_parameters()), dict(resumed[1].model.named_parameters())
    out = {"straight": straight_curve, "resumed": curve,
           "param_diff": max((full(a[k]) - full(b[k])).abs().max().item() for k in a)}
    if resumed[3].__class__.__name__ == "MainParamOptimizer":
        bad = {k: v for k, v in opt_state.items() if k != "main_params"}
        try:  # a state without the fp32 copies (an fp32 model's) is refused, nothing changed
            built()[3].load_state_dict(bad)
            out["refused"] = not any(resumed[3].copies)
        except ValueError as e:
            out["refused"] = "has none" in str(e)
        if opt_state.get("main_params"):  # another layout's shapes: refused
            cut = {**opt_state, "main_params": {i: m[:-1] for i, m in opt_state["main_params"].items()}}
            try:
                built()[3].load_state_dict(cut)
                out["refused"] = False
            except ValueError as e:
                out["refused"] = out["refused"] and "do not fit" in str(e)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,extra", [(1, ["train.dtype=bf16"]), (2, ["train.dtype=bf16", "parallel.zero=1"]),
                                         (2, ["train.dtype=fp16", "parallel.zero=2"]), (2, ["parallel.zero=1"])],
                         ids=["bf16", "bf16-zero1-dp2", "fp16-zero2-dp2", "fp32-zero1-dp2"])
def test_resuming_from_state_dicts_continues_exactly(world, extra):
    """A 16-bit model's fp32 main parameters travel in the optimizer's state dict (before, a
    resumed bf16 run updated the initial fp32 copies and wrote them over the loaded weights): the
    resumed steps' losses and gradient norms are the straight run's, to the bit."""
    for out in run_ranks(_resume_worker, world, extra, timeout=280):
        assert out["resumed"] == out["straight"], out
        assert out["param_diff"] == 0.0, out
        assert out["refused"], out


def _failed_zero_bubble_step_worker(rank: int, world: int, fail: bool) -> dict:
    """pp=2 ZB-H1: a step, then (``fail``) a step that raises after micro-batch 7's I and before
    its W, then a step; the last step's loss and gradient norm."""
    topo = Topology.build(pp=2)
    cfg = validate(load_config(None, BASE + ["parallel.pp=2", "parallel.schedule=zb-h1", "model.tie_embeddings=false",
                                             "parallel.overlap_grad_reduce=false"]), world)
    stage = build(cfg, topo)
    data_parallel, optimizer = stage.data_parallel, stage.optimizer
    batches = my_micro_batches(0, topo)
    executor = stage.executor(len(batches))
    train_step(optimizer, batches, topo, executor, data_parallel, clip_grad=0.0)
    if fail:
        store, run = stage.wgrad_store, stage.wgrad_store.run

        def failing(key):
            if key == (7, 0):
                stage.p2p.wait_sends()
                raise RuntimeError("injected failure before W 7")
            run(key)
        store.run = failing
        with pytest.raises(RuntimeError, match="injected failure"):
            train_step(optimizer, batches, topo, executor, data_parallel, clip_grad=0.0)
        store.run = run
        optimizer.zero_grad()
    r = train_step(optimizer, batches, topo, executor, data_parallel, clip_grad=0.0)
    return {"loss": float(r.loss), "norm": float(r.grad_norm)}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failed_zero_bubble_step_leaves_no_weight_gradient_to_the_next():
    """The weight gradients a failed step deferred (its W never ran) are dropped, not added to
    the next step's (which then equals the step after a clean one: the failed step updated nothing)."""
    clean, after_failure = (run_ranks(_failed_zero_bubble_step_worker, 2, fail, timeout=120) for fail in (False, True))
    for a, b in zip(clean, after_failure):
        assert a == b


@pytest.mark.parametrize("zero", [True, 1.0, 4, -1, "1"])
def test_bytes_per_parameter_refuses_a_zero_that_is_not_0_to_3(zero):
    with pytest.raises(ValueError, match=f"zero must be one of the integers 0, 1, 2, 3, not {zero!r}"[:40]):
        bytes_per_parameter(zero, 2)


@pytest.mark.parametrize("kw,named", [({"dp": 0}, "dp must be"), ({"dp": True}, "dp must be"),
                                      ({"bucket_size": 0}, "bucket_size must be")])
def test_buffer_refuses_a_size_below_one_by_name(kw, named):
    from tessera.distributed.buffers import ParamAndGradBuffer

    args = dict(param_dtype=torch.float32, grad_dtype=torch.float32, bucket_size=100, dp=2,
                device=torch.device("cpu")) | kw
    with pytest.raises(ValueError, match=named):
        ParamAndGradBuffer([torch.nn.Parameter(torch.zeros(3))], **args)
