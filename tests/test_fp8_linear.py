"""FP8's fast path (``train.fp8``, tensor_parallel/fp8_linear.py): the fp8 linear traced whole by
torch.compile (no graph break, with and without a weight-gradient store) and equal to the eager
layer; compiled fp8 layers train as eager ones; ``auto`` compiles fp8 layers where it compiles
bf16 ones; the tensorwise weight cast once per step (never stale after an optimizer step, equal
to casting every micro-batch under accumulation, zero 1 and pipelines); the sequence-parallel
input gathered in fp8, bit-equal to the bf16 gather then the cast; no host syncs on CUDA."""

from __future__ import annotations

import pytest
import torch

from tessera.precision.fp8 import E4M3, Float8Recipe, Float8WeightCache, quantize
from tessera.tensor_parallel.fp8_linear import fp8_linear, gather_quantized
from tessera.tensor_parallel.wgrad import WeightGradStore


class _Sink:
    """A GradSink that keeps each parameter's gradient sum (as DataParallel's main_grad)."""

    def __init__(self):
        self.grads: dict[int, torch.Tensor] = {}

    def accumulate(self, param, grad):
        self.grads[id(param)] = self.grads.get(id(param), 0) + grad.float()

    def accumulate_product(self, param, grad_out, x):
        self.accumulate(param, grad_out.t() @ x)


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 12, 32, generator=g) * torch.linspace(0.1, 4, 32)).requires_grad_()
    w = (torch.randn(16, 32, generator=g) * 0.3).requires_grad_()
    b = torch.randn(16, generator=g).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_dynamo_traces_the_fp8_linear_in_one_graph(scaling):
    """``torch._dynamo.explain`` (tracing only, no inductor): the fp8 linear of a layer whose
    weight a fused store registered, forward and the norm-like work around it, is one graph with
    no break."""
    import torch._dynamo

    torch._dynamo.reset()
    x, w, b = _operands()
    store = WeightGradStore(sink=_Sink(), fuse=True)
    store.register([w])

    def layer(x, w, b):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.nn.functional.silu(fp8_linear(x, w, b, Float8Recipe(scaling), store=store))

    explained = torch._dynamo.explain(layer)(x, w, b)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("with_store", [False, True])
def test_the_compiled_fp8_linear_has_no_graph_break_and_equals_eager(scaling, with_store):
    """fullgraph=True: the casts, amaxes and GEMMs in one graph (and so no host sync: a value read
    on the host would break it); with a registered fused store, the weight gradient filed by
    ``tessera::fp8_input_grad`` into the sink. Output and gradients equal eager's to fp32 rounding
    (inductor computes the same products in another order)."""
    import torch._dynamo

    torch._dynamo.reset()
    recipe = Float8Recipe(scaling)
    x, w, b = _operands()
    results = []
    for compiled in (False, True):
        sink = _Sink()
        store = None
        if with_store:
            store = WeightGradStore(sink=sink, fuse=True)
            store.register([w])

        def layer(x, w, b, store=store):
            return torch.nn.functional.gelu(fp8_linear(x, w, b, recipe, store=store)) * 2

        fn = torch.compile(layer, fullgraph=True) if compiled else layer
        x.grad = w.grad = b.grad = None
        y = fn(x, w, b)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        dw = sink.grads[id(w)] if with_store else w.grad
        assert (w.grad is None) == with_store, "a stored weight gradient goes to the sink, not .grad"
        results.append((y.detach(), x.grad.clone(), dw.clone(), b.grad.clone()))
    for got, want, what in zip(results[1], results[0], ("y", "dx", "dw", "db")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{scaling} {what}: {m}")


def _compiled_runs(scaling: str, fusion: bool) -> tuple[dict, dict]:
    from training_runs import train_run

    from tessera.topology import Topology

    sets = ["model.family=llama", "model.kv_heads=1", f"train.fp8={scaling}", f"train.grad_accum_fusion={fusion}",
            "optim.lr=1e-3"]
    eager = train_run(Topology.build(), sets + ["train.compile=false"])
    compiled = train_run(Topology.build(), sets + ["train.compile=true"])
    return eager, compiled


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scaling,fusion", [("tensorwise", True), ("rowwise", False)])
def test_compiled_fp8_layers_train_as_eager_ones(scaling, fusion):
    """llama (RMSNorm, RoPE, SwiGLU around the fp8 GEMMs) in fp32, 5 steps of 8 micro-batches:
    compiled layers with no graph break give eager's losses within 1e-6 and gradient norms within
    1e-4 (measured: 6e-6, rowwise's last step). Tensorwise with fused weight gradients through the
    store, as ``auto`` runs on a GPU; rowwise through autograd. At lr 1e-3: at the usual 1e-2,
    inductor's other order of fp32 sums moves a value across an fp8 rounding boundary now and
    then by step 3 and Adam's steps on tiny gradients carry it on (1e-5 in the losses, 1 % in
    the norms by step 5)."""
    eager, compiled = _compiled_runs(scaling, fusion)
    assert compiled["graph_breaks"] == 0
    for what, rel in (("losses", 1e-6), ("norms", 1e-4)):
        for a, b in zip(eager[what], compiled[what]):
            assert b == pytest.approx(a, rel=rel), (what, eager[what], compiled[what])


def test_auto_compiles_fp8_layers_of_both_families_at_tp1():
    """make_plan for a CUDA device (nothing allocated): auto compiles fp8 layers at tp=1 for both
    families (with fused weight gradients), where bf16 compiles only llama's; train.compile=false
    keeps them eager; at tp=2 auto compiles nothing; the tensorwise weight cache is planned
    for eager layers (not compiled, not graphed) except under FSDP (zero=3)."""
    from tessera.config import load_config
    from tessera.training.plan import make_plan
    from tessera.training.preflight import validate

    def plan(*sets):
        cfg = load_config(None, ["model.family=llama", "model.kv_heads=2", "model.heads=4", "model.hidden=32",
                                 "model.layers=2", "train.micro_batch=1", "train.global_batch=8", *sets])
        validate(cfg, 8 if "parallel.tp=2" in sets or "parallel.zero=3" in sets else 1)
        return make_plan(cfg, torch.device("cuda"))

    for fp8 in ("tensorwise", "rowwise"):
        one = plan(f"train.fp8={fp8}")
        assert (one.compiled, one.fuse_wgrad) == (True, True) and (plan().compiled, plan().fuse_wgrad) == (True, True)
        assert plan(f"train.fp8={fp8}", "model.family=gpt2", "model.kv_heads=0").compiled
        assert not plan("model.family=gpt2", "model.kv_heads=0").compiled
        assert not plan(f"train.fp8={fp8}", "train.compile=false").compiled
        assert not plan(f"train.fp8={fp8}", "parallel.tp=2").compiled
        assert not one.fp8_weight_cache  # compiled layers cast in their kernels
        eager_tp2 = ("parallel.tp=2", "train.cuda_graphs=false")
        assert plan(f"train.fp8={fp8}", *eager_tp2).fp8_weight_cache == (fp8 == "tensorwise")
        assert not plan(f"train.fp8={fp8}", "parallel.tp=2").fp8_weight_cache  # graphed: cast in the replay
    assert not plan("train.fp8=tensorwise", *eager_tp2, "parallel.zero=3").fp8_weight_cache


def test_the_weight_cache_casts_once_until_the_weight_changes():
    """A second lookup reuses the copy; an in-place write to the weight (its version counter) or
    an invalidation (the optimizer's step hook) casts again; another weight has its own entry."""
    cache, calls = Float8WeightCache(), []
    w = torch.randn(8, 4)

    def cast():
        calls.append(1)
        return quantize(w, E4M3, (0, 1), False, None)

    first = cache.get(w, cast)
    assert cache.get(w, cast) is first and len(calls) == 1
    with torch.no_grad():
        w.mul_(2)  # an optimizer's in-place update
    again = cache.get(w, cast)
    assert len(calls) == 2 and torch.equal(again[1], first[1] * 2)
    cache.invalidate()
    assert len(cache) == 0
    cache.get(w, cast)
    assert len(calls) == 3
    cache.get(torch.randn(8, 4), lambda: quantize(w, E4M3, (0, 1), False, None))
    assert len(cache) == 2


def test_cached_weights_equal_casting_every_micro_batch():
    """A column and a row layer over 3 micro-batches of gradient accumulation, an optimizer step,
    3 more: with the cache, outputs and accumulated gradients equal those of layers that cast
    every micro-batch, bit for bit; the cache casts each weight once per step; after the step the
    new weights are cast (the step hook invalidates), never the old copies."""
    from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    recipe = Float8Recipe("tensorwise")
    runs = []
    for cached in (False, True):
        cache = Float8WeightCache() if cached else None
        col = ColumnParallelLinear(32, 48, tp_group=None, fp8=recipe, fp8_cache=cache)
        row = RowParallelLinear(48, 32, tp_group=None, fp8=recipe, fp8_cache=cache)
        col.reset_parameters(torch.Generator().manual_seed(1))
        row.reset_parameters(torch.Generator().manual_seed(2))
        params = [*col.parameters(), *row.parameters()]
        opt = torch.optim.SGD(params, lr=0.5)
        if cache is not None:
            opt.register_step_post_hook(cache.invalidate)
        outs, g = [], torch.Generator().manual_seed(3)
        for step in range(2):
            for _ in range(3):
                y = row(torch.relu(col(torch.randn(4, 2, 32, generator=g))))
                (y * torch.linspace(-1, 1, 32)).sum().backward()
                outs.append(y.detach())
                if cache is not None:
                    assert len(cache) == 2  # one copy per weight, kept over the micro-batches
            outs += [p.grad.clone() for p in params]
            opt.step()
            opt.zero_grad()
            if cache is not None:
                assert len(cache) == 0, "the optimizer step must drop the copies of the old weights"
        runs.append(outs)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_the_trainers_optimizer_step_drops_the_cached_weights():
    """As ``build`` wires it: before each optimizer step the cache holds one copy per fp8 weight
    (2 layers x QKV, output projection, fc1, fc2), after it none, so the next forward casts the
    updated weights (even where an update would not move a version counter)."""
    from training_runs import STEPS, train_run

    from tessera.topology import Topology

    seen = []

    def prepare(stage, data_parallel):
        cache, inner = stage.chunks[0].tp.fp8_cache, stage.optimizer.inner
        inner.register_step_pre_hook(lambda *_: seen.append(len(cache)))
        inner.register_step_post_hook(lambda *_: seen.append(len(cache)))  # (after build's)

    train_run(Topology.build(), ["train.fp8=tensorwise"], prepare=prepare)
    assert seen == [8, 0] * STEPS


def _cache_worker(rank: int, world: int, layouts: list[list[str]]) -> list[tuple]:
    """Each layout's losses and gradient norms with the planned cache (and its lookups and casts),
    and with it removed from the layers (every micro-batch casts)."""
    from training_runs import train_run

    from tessera.topology import Topology

    counts = {"lookups": 0, "casts": 0}

    def counted(chunks):
        cache = chunks[0].tp.fp8_cache
        get = cache.get

        def counting_get(weight, cast):
            counts["lookups"] += 1
            return get(weight, lambda: (counts.__setitem__("casts", counts["casts"] + 1), cast())[1])
        cache.get = counting_get

    def uncached(chunks):
        for chunk in chunks:
            for m in chunk.modules():
                if getattr(m, "fp8_cache", None) is not None:
                    m.fp8_cache = None

    out = []
    for sets in layouts:
        topo = Topology.build(pp=2 if "parallel.pp=2" in sets else 1)
        counts.update(lookups=0, casts=0)
        runs = [train_run(topo, ["train.fp8=tensorwise", *sets], setup=setup) for setup in (counted, uncached)]
        out.append(([(r["losses"], r["norms"]) for r in runs], dict(counts)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_weight_cache_trains_as_casting_every_micro_batch_on_zero1_and_pipelines():
    """On two ranks, dp=2 with zero 1 (the weights come back by the parameter all-gather), pp=2
    under 1f1b and zb-h1 (deferred weight gradients): 5 steps of gradient accumulation with the
    cache give the losses and gradient norms of casting every micro-batch, exactly, with one cast
    per weight and step (one lookup per micro-batch)."""
    from tessera.testing import run_ranks

    layouts = [["parallel.zero=1"], ["parallel.pp=2", "parallel.schedule=1f1b"],
               ["parallel.pp=2", "parallel.schedule=zb-h1"]]
    for rank_result in run_ranks(_cache_worker, 2, layouts, timeout=400):
        for sets, ((cached, uncached), counts) in zip(layouts, rank_result):
            assert cached == uncached, sets
            micro_batches = 8 // (2 if "parallel.zero=1" in sets else 1)  # (the global batch of 8 over dp)
            assert counts["lookups"] == micro_batches * counts["casts"] > 0, (sets, counts)


def _gather_worker(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    full = torch.randn(8, 2, 16, generator=g) * torch.linspace(0.1, 9, 16)
    full[3, 1, 7] = 40.0  # the amax on rank 0's slice only
    xq, xs = gather_quantized(full.chunk(world, 0)[rank].bfloat16(), dist.group.WORLD)
    ref_q, ref_s = quantize(full.bfloat16(), E4M3, (0, 1, 2), False, None)
    return xq.view(torch.uint8), xs, ref_q.view(torch.uint8), ref_s


@pytest.mark.timeout(120)
def test_the_fp8_sequence_gather_equals_the_bf16_gather_then_the_cast():
    """Each rank quantizes its sequence slice under the whole tensor's scale and the ranks gather
    the fp8 bytes: the same bytes and factor as quantizing the gathered bf16 tensor."""
    from tessera.testing import run_ranks

    for xq, xs, ref_q, ref_s in run_ranks(_gather_worker, 2, timeout=90):
        assert torch.equal(xq, ref_q) and torch.equal(xs, ref_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_fp8_linear_never_waits_for_the_gpu(scaling):
    """CUDA's sync debug mode raises on any host synchronisation: the fp8 linear's forward and
    backward, eager and with the weight cache, run without one."""
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    cache = Float8WeightCache()
    fp8_linear(x, w, None, Float8Recipe(scaling), cache=cache).sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            fp8_linear(x, w, None, Float8Recipe(scaling), cache=cache).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _compiled_tp2_worker(rank: int, world: int) -> dict:
    from training_runs import train_run

    from tessera.topology import Topology

    topo = Topology.build(tp=2)
    sets = ["model.family=llama", "model.kv_heads=2", "model.heads=2", "parallel.tp=2",
            "parallel.sequence_parallel=true", "train.fp8=tensorwise", "optim.lr=1e-3"]
    runs = {c: train_run(topo, sets + [f"train.compile={c}"]) for c in ("false", "true")}
    return {c: (r["losses"], r["norms"], r["graph_breaks"]) for c, r in runs.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_fp8_layers_at_tp2_with_sp_train_as_eager_ones():
    """train.compile=true at tp=2 + SP with fp8: the amax all-reduce, the fp8 input gather and its
    reduce-scatter are tessera's opaque ops inside the graph (no graph break), and the losses are
    eager's within 1e-6."""
    from tessera.testing import run_ranks

    for result in run_ranks(_compiled_tp2_worker, 2, timeout=500):
        (eager, eager_norms, _), (compiled, norms, breaks) = result["false"], result["true"]
        assert breaks == 0
        assert compiled == pytest.approx(eager, rel=1e-6) and norms == pytest.approx(eager_norms, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("rowwise", [False, True])
def test_the_scaled_mm_call_compiles_and_equals_the_emulation(rowwise):
    """The GEMM as CUDA runs it (``torch._scaled_mm``, here its CPU kernel), compiled fullgraph,
    tensorwise and rowwise factors, an e5m2 gradient times an e4m3 weight (as dx), bf16 out:
    the emulated product rounded to bf16."""
    import torch._dynamo

    from tessera.precision.fp8 import E5M2, scaled_matmul

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    gq, gs = quantize(torch.randn(32, 48, generator=g), E5M2, (1,) if rowwise else (0, 1), False, None)
    wq, ws = quantize(torch.randn(48, 64, generator=g), E4M3, (0,) if rowwise else (0, 1), False, None)
    compiled = torch.compile(lambda *args: scaled_matmul(*args, torch.bfloat16, kernel=True), fullgraph=True)
    got = compiled(gq, gs, wq, ws)
    want = scaled_matmul(gq, gs, wq, ws, torch.float32, kernel=False)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6)
