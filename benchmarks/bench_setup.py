"""What the profilers share: a benchmark model built on this rank with tessera's public build API,
as ``tessera train`` builds it, and its training step.

    bench = setup(sys.argv[1:])     # [MODEL] [section.key=value ...]; MODEL: benchmarks/models/ name
    executor, result = bench.step()
    bench.close()                   # the CUDA graphs freed, then the process group

Run under torchrun like the trainer (``torchrun --nproc-per-node N benchmarks/PROFILER.py ...``);
a single process needs no torchrun. The step is ``training.step.train_step`` without the trainer's
non-finite guard, loss scaler and logging (the guard's cost was not measurable: BENCHMARKS.md,
Fast-path safety).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
# (benchmarks/ is on sys.path when a script here runs)
from quick_train import model_config

from tessera.config import Config, load_config
from tessera.training.build import Parts, build, build_topology
from tessera.training.cuda_graphs import LayerGraphs, release_all, step_stream
from tessera.training.data_feed import DataFeed
from tessera.training.launch import init_distributed, pick_device, shutdown, world_from_env
from tessera.training.plan import make_plan
from tessera.training.preflight import check_runnable
from tessera.training.step import StepResult, train_step


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    """``[MODEL] [section.key=value ...]`` -> (MODEL, overrides); MODEL defaults to gpt-1.3b."""
    names = [a for a in argv if "=" not in a]
    if len(names) > 1:
        raise SystemExit(f"one model, then section.key=value overrides; got {names}")
    return (names[0] if names else "gpt-1.3b"), [a for a in argv if "=" in a]


@dataclass
class Bench:
    """This rank's share of a benchmark run, ready to step."""

    cfg: Config
    rank: int
    world: int
    overrides: list[str]
    parts: Parts
    data: DataFeed
    graphs: list[LayerGraphs]
    stream: contextlib.ExitStack = field(repr=False)  # graphed layers: the step's stream, entered

    @property
    def topo(self):
        return self.parts.topo

    def step(self, micro_batches: list[dict] | None = None):
        """One training step on ``micro_batches`` (by default the next batch): (its executor, its
        StepResult)."""
        micro_batches = self.data.next() if micro_batches is None else micro_batches
        executor = self.parts.executor(len(micro_batches))
        result: StepResult = train_step(self.parts.optimizer, micro_batches, self.topo, executor,
                                        self.parts.data_parallel, clip_grad=self.cfg.optim.clip_grad)
        return executor, result

    def close(self) -> None:
        release_all(self.graphs)  # a graph holding NCCL work would hang destroy_process_group
        self.stream.close()
        shutdown()


def setup(argv: list[str]) -> Bench:
    model, overrides = parse_args(argv)
    rank, local_rank, world = world_from_env()
    cfg = check_runnable(load_config(model_config(model), overrides), world)
    device = pick_device(cfg.train.device, local_rank)
    init_distributed(device, cfg.train.timeout_s)
    topo = build_topology(cfg, device)
    parts = build(cfg, topo, make_plan(cfg, device))
    parts.model.train()
    # graphed layers are captured and trained on a stream of their own, as the trainer does, for
    # the rest of the process (Bench.close leaves it)
    stream = contextlib.ExitStack()
    if parts.plan.graphed:
        stream.enter_context(step_stream(device))
    graphs = parts.capture_graphs()
    if rank == 0:
        print(f"BENCH {model} world={world} {' '.join(overrides)}: {parts.plan.describe(cfg)}", flush=True)
    return Bench(cfg=cfg, rank=rank, world=world, overrides=overrides, parts=parts, data=DataFeed(cfg, topo),
                 graphs=graphs, stream=stream)


@contextlib.contextmanager
def timed_calls(calls: list[tuple[object, str, str]]):
    """For the steps run inside: each ``(owner, name, label)`` call records a CUDA event as it is
    entered and left. Yields the list the events go into, ``[(label, start, end)]`` in call order;
    the calls are put back on leaving. (An owner without that attribute is passed over, e.g.
    FSDP's data parallelism has no parameter gather to start.)"""
    events, patched = [], []

    def timed(original, label):
        def call(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(*args, **kwargs)
            end.record()
            events.append((label, start, end))
            return out
        return call

    try:
        for owner, name, label in calls:
            if owner is not None and hasattr(owner, name):
                own = name in getattr(owner, "__dict__", {})  # a module's function, or the instance's own
                original = getattr(owner, name)
                setattr(owner, name, timed(original, label))
                patched.append((owner, name, original if own else None))
        yield events
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)  # the class's method shows through again
            else:
                setattr(owner, name, original)
