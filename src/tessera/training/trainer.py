"""The training loop that ties the stack together: config -> topology -> model -> data -> steps.

Order of construction (each piece receives what it needs explicitly):
topology -> RNG tracker -> model (this rank's TP shard, seeded full-matrix init) -> optimizer
-> data (read on TP rank 0, broadcast inside the TP group) -> steps -> metrics -> sample.
"""

from __future__ import annotations

import time

import torch

from tessera.config import Config, ConfigError, to_dict, validate
from tessera.data import BuiltinCorpus, ByteTokenizer, MicroBatches, SyntheticTokens
from tessera.inference.generate import generate
from tessera.models import GPTModel, TPContext
from tessera.optim import DynamicLossScaler, build_optimizer, learning_rate
from tessera.tensor_parallel import RNGTracker, broadcast_batch
from tessera.topology import Topology
from tessera.training.launch import init_distributed, pick_device, world_from_env
from tessera.training.metrics import JsonlLogger, NullLogger
from tessera.training.step import train_step


def check_runnable(cfg: Config, world_size: int) -> Config:
    """Every check that can refuse the run, done before any process group or model exists."""
    validate(cfg, world_size)
    if cfg.parallel.pp > 1 or cfg.parallel.vpp > 1:
        raise ConfigError("parallel.pp", "pipeline parallelism (pp > 1, vpp > 1) is not implemented yet",
                          "set parallel.pp=1 and parallel.vpp=1")
    if cfg.data.source == "builtin" and cfg.model.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the byte "
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


def build_model(cfg: Config, topo: Topology, rng: RNGTracker | None) -> GPTModel:
    tp = TPContext(group=topo.group("tp"), sequence_parallel=cfg.parallel.sequence_parallel, rng=rng)
    model = GPTModel(cfg.model, tp, device=topo.device)
    model.init_weights(cfg.train.seed)
    return model


def train(cfg: Config) -> list[dict]:
    """Run ``cfg`` under the current launch (torchrun or a single process). Returns the metrics
    logged on this rank (empty on ranks that do not log)."""
    rank, local_rank, world = world_from_env()
    check_runnable(cfg, world)
    device = pick_device(cfg.train.device, local_rank)
    init_distributed(device, cfg.train.timeout_s)
    p, t = cfg.parallel, cfg.train
    topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp, device=device)
    rng = RNGTracker.for_rank(t.seed, topo.tp_rank, topo.pp_rank, device)
    model = build_model(cfg, topo, rng)
    optimizer = build_optimizer(model, cfg.optim)
    scaler = DynamicLossScaler() if t.dtype == "fp16" else None
    data = build_data(cfg, topo)
    logs = topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0
    logger = JsonlLogger(t.out_dir, t.log_every) if logs else NullLogger()
    n_params = sum(p.numel() for p in model.parameters())
    logger.print(f"tessera: {cfg.model.family} with {n_params:,} parameters on this rank, "
                 f"{topo!r}, device {device}, {t.dtype}")

    history = []
    model.train()
    for step in range(t.steps):
        start = time.perf_counter()
        lr = learning_rate(step, cfg.optim, t.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = next_micro_batches(data, topo)
        result = train_step(model, optimizer, micro_batches, topo, clip_grad=cfg.optim.clip_grad,
                            dtype=t.dtype, scaler=scaler)
        elapsed = time.perf_counter() - start
        metrics = {"step": step + 1, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
                   "tokens_per_s": result.tokens / elapsed, "tokens": result.tokens,
                   "step_time_s": elapsed}
        if scaler is not None:
            metrics.update(loss_scale=scaler.scale, skipped=result.skipped)
        logger.log(metrics)
        if logs:
            history.append(metrics)

    if t.sample_tokens:
        tokenizer = ByteTokenizer()
        ids = generate(model, tokenizer.encode(t.sample_prompt), t.sample_tokens, seed=t.seed)
        logger.print("sample: " + tokenizer.decode(ids))
    return history


__all__ = ["train", "check_runnable", "to_dict"]
