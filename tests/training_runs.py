"""Running training in tests: the pieces the parity tests share.

- ``train_run``: the tiny model of the data-parallel and layout tests (``BASE``: 2 layers, a
  vocabulary of 64, a global batch of ``GLOBAL`` samples) trained for ``STEPS`` steps through
  the trainer's parts (``training/build.py``: data parallelism, the optimizer) and ``train_step``,
  on batches given by the caller (``my_micro_batches``: the same global batch every step), with
  what the tests look at recorded on the way (losses, gradient norms, parameters, the order of
  the collectives and parameter gathers, fused weight gradients).
- ``run_train``: ``tessera train`` as a user runs it (the CLI, torchrun for several processes),
  its metrics.jsonl read back.
- ``train_histories`` / ``train_outputs``: the trainer's ``train`` in ``run_ranks`` workers, each
  run's history (and what it printed).
- ``shared_result``: one multi-rank call's result shared by the tests that read it.

Rank processes import this module to find ``train_histories``' worker, and the test modules
that import it to find theirs: it imports no pytest (about 0.1 s of CPU per rank).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tessera.config import load_config
from tessera.distributed.memory import memory_report
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.build import build, build_chunks
from tessera.training.plan import make_plan
from tessera.training.preflight import validate
from tessera.training.step import train_step


def shared_result(store: dict, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per ``key`` for the tests that share it (one multi-rank call each); a
    failure is remembered and raised again, so that a hang costs one deadline, not one per test."""
    if key not in store:
        try:
            store[key] = compute()
        except Exception as e:
            store[key] = e
    if isinstance(store[key], BaseException):
        raise store[key]
    return store[key]


# -- the tiny model, step by step ------------------------------------------------------------------------
GLOBAL, SEQ, VOCAB, STEPS = 8, 16, 64, 5
BASE = ["model.hidden=32", "model.layers=2", "model.heads=2", f"model.seq_len={SEQ}", f"model.vocab_size={VOCAB}",
        "train.micro_batch=1", f"train.global_batch={GLOBAL}", "optim.lr=1e-2", "optim.warmup=0",
        "optim.clip_grad=0.5", "optim.weight_decay=0.1", "optim.eps=1e-6", "parallel.bucket_size=3000", "train.seed=7"]


def _graph_breaks() -> int:
    """Dynamo's graph breaks so far in this process (0 where nothing was compiled)."""
    import torch._dynamo.utils
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The same batch every step (so 5 steps visibly lower the loss)."""
    g = torch.Generator().manual_seed(1000)
    rows = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    mask = (torch.rand(GLOBAL, SEQ, generator=g) > 0.4).float()
    mask[:, 0] = 1.0
    return {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": mask}


def my_micro_batches(step: int, topo: Topology, micro: int = 1) -> list[dict]:
    """This dp rank's contiguous share of the step's global batch, cut into micro-batches."""
    share = GLOBAL // topo.dp
    batch = {k: v[topo.dp_rank * share:(topo.dp_rank + 1) * share] for k, v in global_batch(step).items()}
    return [{k: v[i:i + micro] for k, v in batch.items()} for i in range(0, share, micro)]


def _recording_order(log: list[str]):
    """Patches that append "p2p" for every pipeline send / receive issued and "sum" for every
    all-reduce DataParallel issues (the tied embedding's sum over the embedding group)."""
    from tessera.distributed import collectives
    from tessera.pipeline_parallel.p2p import P2P
    send, recv, all_reduce = P2P.send, P2P.recv, collectives.all_reduce

    def patched(fn, tag):
        def call(*args, **kwargs):
            log.append(tag)
            return fn(*args, **kwargs)
        return call
    return [(P2P, "send", send, patched(send, "p2p")), (P2P, "recv", recv, patched(recv, "p2p")),
            (collectives, "all_reduce", all_reduce, patched(all_reduce, "sum"))]


def train_run(topo: Topology, overrides: list[str], *, batches=my_micro_batches, scaler=None, hook=None,
              prepare=None, setup=None, steps: int = STEPS) -> dict:
    """``BASE + overrides`` trained for ``steps`` steps on ``batches(step, topo)`` (this rank's
    micro-batches). ``hook(step, stage)``: before each step; ``prepare(stage, data_parallel)``:
    called once built, before the first step; ``setup(chunks)``: before data parallelism wraps
    the model chunks."""
    cfg = load_config(None, BASE + overrides)
    validate(cfg, topo.world_size)
    plan = make_plan(cfg, topo.device)
    chunks = build_chunks(cfg, topo, plan, RNGTracker.for_rank(cfg.train.seed, topo.tp_rank, topo.pp_rank))
    if setup is not None:
        setup(chunks)
    stage = build(cfg, topo, plan, chunks=chunks)
    data_parallel, optimizer = stage.data_parallel, stage.optimizer
    if prepare is not None:
        prepare(stage, data_parallel)
    memory = memory_report(data_parallel, optimizer)
    fused = []  # weights whose gradient the GEMM added straight into main_grad
    store = stage.wgrad_store
    rows = []  # embeddings whose lookup's rows were added straight into main_grad
    if store is not None and store.fuse:
        inner = data_parallel.accumulate_product
        data_parallel.accumulate_product = lambda p, *ab: (fused.append(p), inner(p, *ab))
        add_rows = data_parallel.accumulate_rows
        data_parallel.accumulate_rows = lambda p, *ig: (rows.append(p), add_rows(p, *ig))
    # how many deferred weight-gradient computations (W) ran after the tied embedding's sum over
    # the embedding group had started (its overlap with backward)
    w_after_tied = []
    if store is not None:
        run_w = store.run
        store.run = lambda key: (w_after_tied.append(bool(getattr(data_parallel, "tied_reduced", ()))), run_w(key))
    # the optimizer's updates (S) and parameter gathers started (G, with the buckets' count), in
    # order; the buckets in the order their gathers start, and in the order the forward first
    # waits for them (forward pre-hooks)
    opt_events, gathered, waited = [], [], []
    if hasattr(optimizer, "inner") and hasattr(data_parallel, "start_param_gather"):
        inner_step, gather, wait = optimizer.inner.step, data_parallel.start_param_gather, data_parallel.wait_param_gather

        def key(rng):  # (model chunk, bucket)
            return data_parallel.buffers.index(rng.buffer), rng.bucket.index

        def recording_gather():  # the buckets in the order start_param_gather starts them
            before = set(data_parallel._gathers)
            out = gather()
            started = [b for b in data_parallel._gathers if b not in before]  # dicts keep insertion order
            opt_events.append(f"G{len(started)}")
            gathered.extend(key(next(r for r in data_parallel.ranges if r.bucket is b)) for b in started)
            return out

        def recording_wait(buckets=None):
            pending = set(data_parallel._gathers)
            waited.extend(key(next(r for r in data_parallel.ranges if r.bucket is b))
                          for b in (buckets or []) if b in pending)
            return wait(buckets)

        optimizer.inner.step = lambda *a, **k: (opt_events.append("S"), inner_step(*a, **k))[1]
        data_parallel.start_param_gather = recording_gather
        data_parallel.wait_param_gather = recording_wait
    losses, norms, skipped, order = [], [], [], []
    breaks = _graph_breaks()
    patches = _recording_order(log := []) if topo.pp > 1 else []
    for owner, name, _, new in patches:
        setattr(owner, name, new)
    for step in range(steps):
        micro_batches = batches(step, topo)
        if hook is not None:
            hook(step, stage)
        log.clear() if patches else None
        r = train_step(optimizer, micro_batches, topo, stage.executor(len(micro_batches)), data_parallel,
                       clip_grad=cfg.optim.clip_grad, scaler=scaler)
        order.append("".join(t[0] for t in log) if patches else "")
        losses.append(r.loss)
        norms.append(r.grad_norm)
        skipped.append(r.skipped)
    for owner, name, old, _ in patches:
        setattr(owner, name, old)
    data_parallel.wait_param_gather()
    params = {}
    for chunk in stage.chunks:
        for name, p in chunk.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p  # FSDP: gather the dp shards
            params[name] = full.detach().float().clone()
    return dict(losses=losses, norms=norms, skipped=skipped, params=params, memory=memory,
                state_bytes=optimizer.state_bytes(), tp_rank=topo.tp_rank, pp_rank=topo.pp_rank,
                dp_rank=topo.dp_rank, schedule=stage.plan.schedule, fused_calls=len(fused),
                fused_rows=len(rows), w_after_tied=sum(w_after_tied),
                tied_by_dp=bool(getattr(data_parallel, "tied_reduced", ())),
                order=order, opt_events=opt_events, ranges=len(getattr(data_parallel, "ranges", ())),
                gathered=gathered, waited=waited, graph_breaks=_graph_breaks() - breaks)


# -- the command line ------------------------------------------------------------------------------------
TINY = ["model.hidden=64", "model.layers=2", "model.heads=4", "model.seq_len=32", "train.micro_batch=2",
        "train.global_batch=8", "train.steps=10", "train.log_every=5", "optim.warmup=3", "optim.lr=1e-3"]


def run_train(out_dir, nproc, overrides, timeout=180) -> tuple[list[dict], str]:
    """``tessera train`` on ``nproc`` processes with ``TINY + overrides``: its metrics.jsonl
    (one dict per step) and what it printed."""
    sets = [arg for item in TINY + overrides + [f"train.out_dir={out_dir}"] for arg in ("--set", item)]
    command = [sys.executable, "-m", "tessera", "train", *sets]
    if nproc > 1:
        command[4:4] = ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], proc.stdout


# -- the trainer in rank processes -----------------------------------------------------------------------
def _train_runs(rank: int, world: int, base: list[str], runs: list[list[str]],
                env: dict[str, str]) -> list[tuple[list[dict], str] | None]:
    """Each run's metrics and what it printed, on the logging rank (None elsewhere)."""
    import os

    from tessera.training.trainer import train

    os.environ.update(env)
    out = []
    for overrides in runs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = train(load_config(None, base + overrides))
        out.append((history, printed.getvalue()) if history else None)
    return out


def train_outputs(world: int, base: list[str], runs: list[list[str]], timeout: float = 240,
                  env: dict[str, str] | None = None) -> list[tuple[list[dict], str]]:
    """``train`` (what each worker of ``tessera train`` runs) on ``world`` ranks for each run's
    ``base + overrides``, one after the other in one ``run_ranks`` call: each run's history (the
    metrics the logging rank logged) and the lines that rank printed. ``env``: set in the rank
    processes first (they are forked from a server started once, with the environment of then)."""
    by_rank = run_ranks(_train_runs, world, base, runs, env or {}, timeout=timeout)
    return [next(h[i] for h in by_rank if h[i] is not None) for i in range(len(runs))]


def train_histories(world: int, base: list[str], runs: list[list[str]], timeout: float = 240) -> list[list[dict]]:
    """:func:`train_outputs`' histories alone."""
    return [history for history, _ in train_outputs(world, base, runs, timeout)]
