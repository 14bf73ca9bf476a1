"""The training loop that ties the stack together: config -> topology -> model -> data -> steps.

Order of construction (each piece receives what it needs explicitly):
topology -> RNG tracker -> stage (this rank's model chunks, TP-sharded, seeded full-matrix init;
the schedule's action list and its executor) -> optimizer -> data (read on TP rank 0, broadcast
inside the TP group) -> steps -> metrics -> sample.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
from torch import nn

from tessera.config import Config, ConfigError, to_dict, validate
from tessera.data import BuiltinCorpus, ByteTokenizer, MicroBatches, SyntheticTokens
from tessera.inference.generate import generate
from tessera.models import TPContext
from tessera.optim import DynamicLossScaler, LRScheduler, build_optimizer
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.pipeline_parallel.p2p import P2P
from tessera.pipeline_parallel.schedules import ScheduleError, build_all, build_schedule, check_kind
from tessera.pipeline_parallel.simulator import simulate
from tessera.pipeline_parallel.stage import LayoutError, build_stage_chunks, parse_layout, stage_layer_ranges
from tessera.tensor_parallel import RNGTracker, broadcast_batch
from tessera.tensor_parallel.wgrad import WeightGradStore
from tessera.topology import Topology
from tessera.training.launch import init_distributed, pick_device, world_from_env
from tessera.training.metrics import JsonlLogger, NullLogger
from tessera.training.step import train_step


def choose_schedule(kind: str, pp: int, vpp: int, microbatches: int) -> str:
    """``auto``: the fastest valid kind by the simulator; otherwise ``kind``, checked."""
    if kind != "auto":
        check_kind(kind, pp, vpp, microbatches)
        return kind
    if pp == 1:
        return "none"
    if vpp > 1:
        return "interleaved"
    return min(("1f1b", "zb-h1"), key=lambda k: simulate(build_all(k, pp, 1, microbatches)).step_time)


def check_runnable(cfg: Config, world_size: int) -> Config:
    """Every check that can refuse the run, done before any process group or model exists."""
    validate(cfg, world_size)
    p, m, t = cfg.parallel, cfg.model, cfg.train
    try:
        stage_layer_ranges(m.layers, p.pp, p.vpp, parse_layout(p.pp_layout))
    except LayoutError as e:
        raise ConfigError("parallel.pp_layout" if p.pp_layout else "parallel.vpp", str(e),
                          "change parallel.pp / parallel.vpp or give parallel.pp_layout") from None
    microbatches = t.global_batch // (t.micro_batch * p.dp)
    try:
        kind = choose_schedule(p.schedule, p.pp, p.vpp, microbatches)
        simulate(build_all(kind, p.pp, p.vpp, microbatches), p.vpp)  # proves it cannot hang
    except ScheduleError as e:
        raise ConfigError("parallel.schedule", f"{e} (with {microbatches} micro-batches per step)",
                          "choose another parallel.schedule, or change parallel.pp / vpp / train.global_batch") from None
    if cfg.data.source == "builtin" and m.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the byte "
                          f"tokenizer's {ByteTokenizer.vocab_size} ids of the builtin corpus",
                          "set model.vocab_size >= 256")
    return cfg


def build_data(cfg: Config, topo: Topology) -> MicroBatches | None:
    """The data iterator on TP rank 0; None on the other TP ranks (they receive broadcasts)."""
    if topo.tp_rank != 0:
        return None
    m, t = cfg.model, cfg.train
    if cfg.data.source == "builtin":
        source = BuiltinCorpus(m.seq_len, t.seed)
    else:
        source = SyntheticTokens(m.seq_len, m.vocab_size, t.seed)
    return MicroBatches(source, global_batch=t.global_batch, micro_batch=t.micro_batch,
                        dp=topo.dp, dp_rank=topo.dp_rank)


def next_micro_batches(data: MicroBatches | None, topo: Topology) -> list[dict]:
    """Read (TP rank 0) and broadcast one step's micro-batches, stacked into one message."""
    stacked = None
    if data is not None:
        batches = next(data)
        stacked = {k: torch.stack([mb[k] for mb in batches]) for k in batches[0]}
    stacked = broadcast_batch(stacked, topo.group("tp"), topo.tp_src_rank, topo.device)
    count = next(iter(stacked.values())).shape[0]
    return [{k: v[i] for k, v in stacked.items()} for i in range(count)]


@dataclass
class Stage:
    """This rank's share of the model and how it runs a step."""

    model: nn.ModuleList  # the chunks (virtual stages) this rank holds
    executor: PipelineExecutor
    p2p: P2P | None
    schedule: str


def build_stage(cfg: Config, topo: Topology, rng: RNGTracker | None) -> Stage:
    p = cfg.parallel
    microbatches = cfg.train.global_batch // (cfg.train.micro_batch * topo.dp)
    kind = choose_schedule(p.schedule, p.pp, p.vpp, microbatches)
    store = WeightGradStore() if kind == "zb-h1" else None
    tp = TPContext(group=topo.group("tp"), sequence_parallel=p.sequence_parallel, rng=rng, wgrad_store=store)
    chunks = build_stage_chunks(cfg.model, tp, topo.pp_rank, p.pp, p.vpp, parse_layout(p.pp_layout), topo.device)
    for chunk in chunks:
        chunk.init_weights(cfg.train.seed)
    p2p = P2P(topo) if p.pp > 1 else None
    actions = build_schedule(kind, p.pp, p.vpp, microbatches, topo.pp_rank)
    executor = PipelineExecutor(chunks, actions, p2p, p.pp, topo.pp_rank, store)
    return Stage(nn.ModuleList(chunks), executor, p2p, kind)


def train(cfg: Config) -> list[dict]:
    """Run ``cfg`` under the current launch (torchrun or a single process). Returns the metrics
    logged on this rank (empty on ranks that do not log)."""
    rank, local_rank, world = world_from_env()
    check_runnable(cfg, world)
    device = pick_device(cfg.train.device, local_rank)
    init_distributed(device, cfg.train.timeout_s)
    p, t = cfg.parallel, cfg.train
    topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp, device=device,
                          timeout=datetime.timedelta(seconds=t.timeout_s))
    rng = RNGTracker.for_rank(t.seed, topo.tp_rank, topo.pp_rank, device)
    stage = build_stage(cfg, topo, rng)
    model = stage.model
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = LRScheduler(cfg.optim, t.steps)
    scaler = DynamicLossScaler() if t.dtype == "fp16" else None
    data = build_data(cfg, topo)
    logs = topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0
    logger = JsonlLogger(t.out_dir, t.log_every) if logs else NullLogger()
    n_params = sum(p.numel() for p in model.parameters())
    logger.print(f"tessera: {cfg.model.family} with {n_params:,} parameters on this rank, "
                 f"{topo!r}, schedule {stage.schedule}, device {device}, {t.dtype}")

    history = []
    model.train()
    for step in range(t.steps):
        start = time.perf_counter()
        lr = scheduler.apply(optimizer, step)
        micro_batches = next_micro_batches(data, topo)
        result = train_step(model, optimizer, micro_batches, topo, stage.executor,
                            clip_grad=cfg.optim.clip_grad, dtype=t.dtype, scaler=scaler)
        elapsed = time.perf_counter() - start
        metrics = {"step": step + 1, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
                   "weight_decay": scheduler.weight_decay(step),
                   "tokens_per_s": result.tokens / elapsed, "tokens": result.tokens,
                   "step_time_s": elapsed}
        if scaler is not None:
            metrics.update(loss_scale=scaler.scale, skipped=result.skipped)
        logger.log(metrics)
        if logs:
            history.append(metrics)

    if t.sample_tokens:
        tokenizer = ByteTokenizer()
        ids = generate(list(model), tokenizer.encode(t.sample_prompt), t.sample_tokens, topo=topo,
                       p2p=stage.p2p, seed=t.seed)
        logger.print("sample: " + tokenizer.decode(ids))
    return history


__all__ = ["train", "check_runnable", "to_dict"]
