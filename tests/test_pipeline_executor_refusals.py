"""The pipeline executor's own bookkeeping: its trace records every compute action once; a
micro-batch count its schedule was not built for, a split backward without a weight-gradient
store, and a step after one that failed midway are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_pipeline_executor import (
    SEED,
    Case,
    global_tokens,
    make_cfg,
    make_micro_batches,
)

from tessera.models import GPTModel, TPContext
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.pipeline_parallel.p2p import P2P
from tessera.pipeline_parallel.schedules import COMPUTE, build_schedule
from tessera.pipeline_parallel.stage import build_stage_chunks
from tessera.testing import run_ranks
from tessera.topology import Topology


def test_executor_trace_records_every_compute_action_once(monkeypatch):
    """``PipelineExecutor.trace`` (benchmarks/pipeline_timeline.py): one entry per compute action in
    the schedule's order, its start event recorded before the action and its end event after;
    nothing recorded while ``trace`` is None. CUDA events are replaced by a recording fake."""
    records = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            assert self.at is None, "an event recorded twice"
            self.at = len(records)
            records.append(self)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    case = Case("none", 1, 1, 3, True, "gpt2", seed=7)
    model = GPTModel(make_cfg(case))
    model.init_weights(SEED)
    micro_batches = make_micro_batches(case.m, case.seed)
    actions = build_schedule("none", 1, 1, case.m, 0)
    executor = PipelineExecutor([model], actions, None, 1, 0)
    executor.run(micro_batches, global_tokens(micro_batches))
    assert records == [], "events recorded with trace None"
    executor.trace = []
    executor.run(micro_batches, global_tokens(micro_batches))
    compute = [(a.op.name, a.microbatch, a.chunk) for a in actions if a.op in COMPUTE]
    assert [(op, mb, c) for op, mb, c, *_ in executor.trace] == compute == [
        (op, mb, 0) for mb in range(case.m) for op in ("F", "B")]
    launches = [launched for *_, launched, _, _ in executor.trace]
    assert launches == sorted(launches)
    order = [e.at for *_, start, end in executor.trace for e in (start, end)]
    assert order == list(range(2 * len(compute))), "each action's start and end, once, in order"


def test_executor_refuses_a_micro_batch_count_its_schedule_was_not_built_for():
    case = Case("none", 1, 1, 3, True, "gpt2", seed=7)
    model = GPTModel(make_cfg(case))
    model.init_weights(SEED)
    executor = PipelineExecutor([model], build_schedule("none", 1, 1, 3, 0), None, 1, 0)
    for m in (2, 4):
        micro_batches = make_micro_batches(m, case.seed)
        with pytest.raises(ValueError, match=f"this rank's schedule runs 3 micro-batches, got {m}"):
            executor.run(micro_batches, global_tokens(micro_batches))
    assert all(p.grad is None for p in model.parameters()), "nothing ran"


def _failed_step_worker(rank: int, world: int, fail: bool) -> str:
    """pp=2 1F1B, 4 micro-batches over a trainer's P2P (shapes kept): with ``fail``, step 1
    raises in rank 0's third forward and rank 1's second (each after the messages its peer
    waits for, so neither hangs in step 1), then step 2 is tried on the same P2P."""
    topo = Topology.build(pp=2)
    case = Case("1f1b", 2, 1, 4, False, "gpt2", seed=5)
    chunks = build_stage_chunks(make_cfg(case), TPContext(), topo.pp_rank, 2, 1)
    chunks[0].init_weights(SEED)
    p2p = P2P(topo, keep_shapes=True)
    executor = PipelineExecutor(chunks, build_schedule("1f1b", 2, 1, 4, topo.pp_rank), p2p, 2, topo.pp_rank)
    batches = make_micro_batches(4, case.seed)
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if fail and calls[0] == (3 if rank == 0 else 2):
            raise RuntimeError("injected failure")
    handle = chunks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        executor.run(batches, global_tokens(batches))
    except RuntimeError as e:
        assert "injected" in str(e)
    handle.remove()
    try:
        message = f"step 2: loss {float(executor.run(batches, global_tokens(batches))):.6f}"
    except RuntimeError as e:
        message = str(e)
    # (a rank that returned at once could end its process before a message it posted in step 1
    # reached its peer, whose wait would then fail with "connection closed" instead)
    dist.barrier()
    return message


@pytest.mark.timeout(120)
def test_a_step_failed_midway_makes_the_channel_refuse_the_next():
    """Messages a failed step left posted or due would pair with the next step's (a hang on
    gloo, mixed micro-batches on NCCL): the next step on that P2P says so instead."""
    (clean, _) = run_ranks(_failed_step_worker, 2, False, timeout=60)
    assert clean.startswith("step 2: loss")
    for message in run_ranks(_failed_step_worker, 2, True, timeout=60):
        assert message.startswith("the pipeline's point-to-point channel is unusable: an earlier step failed "
                                  "midway (RuntimeError at action"), message


def test_a_split_backward_schedule_needs_a_weight_gradient_store():
    chunks = build_stage_chunks(make_cfg(Case("zb-h1", 2, 1, 2, False, "gpt2")), TPContext(), 0, 1, 1)
    with pytest.raises(ValueError, match="splits backward into I and W.*WeightGradStore"):
        PipelineExecutor(chunks, build_schedule("zb-h1", 1, 1, 2, 0), None, 1, 0)
