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
from tessera.distributed.memory import bytes_per_parameter
from tessera.models import GPTModel
from tessera.optim import DynamicLossScaler
from tessera.testing import run_ranks
from tessera.topology import Topology
from training_runs import BASE, GLOBAL, STEPS, VOCAB, train_run


def _dp_worker(rank: int, world: int, runs: list[tuple[str, int, int, list[str]]]) -> dict:
    out = {}
    for name, tp, pp, overrides in runs:
        out[name] = train_run(Topology.build(tp=tp, pp=pp), [f"parallel.tp={tp}", f"parallel.pp={pp}", *overrides])
    return out


ZEROS = [f"parallel.zero={z}" for z in range(4)]
# optim.eps: the key-bias gradient is zero in exact arithmetic (softmax ignores it), so it is pure
# rounding noise that a tiny eps would turn into full-size, layout-dependent Adam steps.
RUNS = {
    1: [(f"zero{z}", 1, 1, [ZEROS[z]]) for z in range(4)] + [("untied", 1, 1, [ZEROS[0], "model.tie_embeddings=false"])],
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
       + [(f"zero{z}-fused-untied", 1, 1, [ZEROS[z], "train.grad_accum_fusion=true", "model.tie_embeddings=false"])
          for z in range(3)]
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
    for r, out in enumerate(results(2)):
        for zero in range(3):
            # an untied embedding: its lookup's rows go straight into main_grad too, once per
            # micro-batch, and the untied output layer's GEMM is fused with the others
            run, untied = out[f"zero{zero}-fused-untied"], results(1)[0]["untied"]
            assert run["fused_rows"] == (GLOBAL // 2) * STEPS and untied["fused_rows"] == 0, run["fused_rows"]
            assert run["fused_calls"] == 9 * (GLOBAL // 2) * STEPS, run["fused_calls"]
            assert_same_training(run, untied, f"fused untied dp=2 zero={zero} rank {r}")
            assert_same_params(run["params"], untied, f"fused untied dp=2 zero={zero} rank {r}")
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
