"""Micro-batch pairs on two streams with two TP communicators (parallel.tp_microbatch_pairs,
training/concurrent.py). On gloo there are no streams: a pair runs one after the other, which
checks everything but the overlap itself: the second micro-batch's collectives go over the
second communicator, each micro-batch's gradients arrive in data parallelism as usual, an odd
last micro-batch runs alone, and training equals the run without pairs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_data_parallel import BASE, my_micro_batches
from tessera.config import ConfigError, load_config, validate
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.concurrent import PairedExecutor, TPGroupSwap
from tessera.training.step import train_step
from tessera.training.trainer import Stage, build_data_parallel

STEPS = 3


def _train(topo: Topology, overrides: list[str], count: int) -> dict:
    """STEPS steps on the first ``count`` micro-batches of each dp rank's share; the TP
    all-reduces counted per communicator (without sequence parallelism every TP collective is one)."""
    cfg = validate(load_config(None, BASE + overrides), topo.world_size)
    stage = Stage(cfg, topo, RNGTracker.for_rank(cfg.train.seed, topo.tp_rank, topo.pp_rank))
    data_parallel, optimizer = build_data_parallel(stage, topo, cfg)
    calls: dict[str, int] = {}
    groups = {id(topo.group("tp")): "first", id(getattr(stage, "second_tp", None)): "second"}
    all_reduce = dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        name = groups.get(id(group), "other")
        calls[name] = calls.get(name, 0) + 1
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting
    losses, norms = [], []
    try:
        for step in range(STEPS):
            micro_batches = my_micro_batches(step, topo)[:count]
            executor = stage.executor(len(micro_batches))
            r = train_step(optimizer, micro_batches, topo, executor, data_parallel, clip_grad=cfg.optim.clip_grad)
            losses.append(r.loss)
            norms.append(r.grad_norm)
    finally:
        dist.all_reduce = all_reduce
    if hasattr(data_parallel, "wait_param_gather"):  # zero 1/2: the last update's gather overlaps nothing now
        data_parallel.wait_param_gather()
    params = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    return dict(losses=losses, norms=norms, params=params, calls=calls, paired=isinstance(executor, PairedExecutor))


def _worker(rank: int, world: int, tp: int, overrides: list[str], count: int) -> dict:
    topo = Topology.build(tp=tp)
    layout = [f"parallel.tp={tp}", *overrides]
    return {pairs: _train(topo, layout + [f"parallel.tp_microbatch_pairs={pairs}"], count)
            for pairs in ("false", "true")}


def _assert_same(paired: dict, plain: dict, what: str) -> None:
    """The same training, to the bit: the same sums in the same order."""
    assert paired["losses"] == plain["losses"] and paired["norms"] == plain["norms"], what
    for name, p in paired["params"].items():
        assert torch.equal(p, plain["params"][name]), f"{what}: {name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp,extra,count", [
    (2, 1, [], 8),  # four pairs
    (2, 1, [], 5),  # two pairs and an odd last micro-batch alone
    (2, 2, ["parallel.zero=1"], 4),  # zero 1's overlapped reduce-scatter, and gather (the first pair waits for it)
    (2, 2, ["parallel.zero=2"], 3),  # zero 2 reduces every micro-batch's gradients
])
def test_pairs_train_as_the_micro_batches_one_by_one(tp, dp, extra, count):
    for rank, out in enumerate(run_ranks(_worker, tp * dp, tp, extra, count, timeout=240)):
        plain, paired = out["false"], out["true"]
        assert paired["paired"] and not plain["paired"]
        _assert_same(paired, plain, f"tp={tp} dp={dp} {extra} {count} micro-batches, rank {rank}")
        # the second micro-batch of each pair used the second communicator instead of the first
        pairs = count // 2
        first, second = paired["calls"].get("first", 0), paired["calls"].get("second", 0)
        assert plain["calls"].get("second", 0) == 0 and second > 0, paired["calls"]
        assert first == plain["calls"]["first"] - second, (paired["calls"], plain["calls"])
        assert second % pairs == 0, (paired["calls"], pairs)  # (the step's own all-reduces go over the first)


def _sequence_parallel_worker(rank: int, world: int) -> dict:
    return _worker(rank, world, 2, ["parallel.sequence_parallel=true"], 6)


@pytest.mark.timeout(300)
def test_pairs_under_sequence_parallelism():
    for rank, out in enumerate(run_ranks(_sequence_parallel_worker, 2, timeout=240)):
        assert out["true"]["paired"]
        _assert_same(out["true"], out["false"], f"tp=2 + SP, rank {rank}")


def test_tp_group_swap_swaps_every_reference_and_puts_them_back():
    from tessera.models.transformer import TPContext
    first, second = object(), object()
    ctx = TPContext(group=first)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tp_group, self.tp, self.other = first, ctx, "x"

    model = nn.Sequential(Layer(), nn.Sequential(Layer()))
    swap = TPGroupSwap([model], first, second)
    for _ in range(2):  # found once, swapped at every entry
        with swap:
            assert all(m.tp_group is second for m in model.modules() if isinstance(m, Layer))
            assert ctx.group is second and model[0].other == "x"
        assert all(m.tp_group is first for m in model.modules() if isinstance(m, Layer)) and ctx.group is first
    with pytest.raises(RuntimeError, match="boom"), TPGroupSwap([model], first, second):
        raise RuntimeError("boom")
    assert model[1][0].tp_group is first and ctx.group is first  # put back after an error too
    with pytest.raises(ValueError, match="a TP group"):
        with TPGroupSwap([model], None, second):
            pass


@pytest.mark.parametrize("sets,key", [
    (["parallel.tp=1"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "parallel.pp=2"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "train.compile=true"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "train.grad_accum_fusion=true"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "parallel.zero=3"], "parallel.tp_microbatch_pairs"),
])
def test_pairs_refused_where_they_cannot_run(sets, key):
    cfg = load_config(None, [*sets, "parallel.tp_microbatch_pairs=true"])
    p = cfg.parallel
    with pytest.raises(ConfigError) as e:
        validate(cfg, p.tp * p.pp * 2)
    assert e.value.key == key
