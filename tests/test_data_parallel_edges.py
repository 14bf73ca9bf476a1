"""Data parallelism's edges: parameters without gradients, chunks without parameters, wrapping twice,
uneven buckets, refusals, the memory tables, bf16 on the wire, steps given up, resuming from
state dicts."""

from __future__ import annotations


import pytest
import torch

from tessera.config import load_config
from tessera.distributed.memory import bytes_per_parameter, memory_report
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.build import build, build_chunks
from tessera.training.plan import make_plan
from tessera.training.preflight import validate
from tessera.training.step import train_step
from training_runs import BASE, my_micro_batches



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
