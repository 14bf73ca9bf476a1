"""Assembling this rank's share of a training run, in a fixed order: topology, model chunks (TP
layers, seeded layout-independent init, recompute, compile), data parallelism and the optimizer,
the weight-gradient store that routes deferred or fused gradients into data parallelism's buffers,
the pipeline's point-to-point and executors. ``tessera train`` and the benchmarks build alike.

    topo = build_topology(cfg, device)
    parts = build(cfg, topo, make_plan(cfg, device, topo.tp))
    result = train_step(parts.optimizer, micro_batches, parts.topo, parts.executor(len(micro_batches)),
                        parts.data_parallel, clip_grad=cfg.optim.clip_grad)
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.config import Config
from tessera.distributed.data_parallel import DataParallel
from tessera.distributed.fsdp import FullyShardedDataParallel
from tessera.models import GPTModel, TPContext
from tessera.optim.optimizers import FSDPOptimizer, MainParamOptimizer
from tessera.pipeline_parallel.bridge import Bridge
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.pipeline_parallel.p2p import P2P
from tessera.pipeline_parallel.schedules import build_schedule
from tessera.pipeline_parallel.stage import build_stage_chunks
from tessera.precision import Float8Recipe, Float8WeightCache
from tessera.tensor_parallel import RNGTracker
from tessera.tensor_parallel.random import SelectivePolicy
from tessera.tensor_parallel.wgrad import WeightGradStore
from tessera.stage_topology import StageTopology
from tessera.topology import Topology
from tessera.training.cuda_graphs import LayerGraphs, graph_stage
from tessera.training.plan import ExecutionPlan, make_plan
from tessera.training.preflight import validate
from tessera.training.step import DTYPES


@dataclass
class Parts:
    """This rank's share of a training run (:func:`build`)."""

    cfg: Config
    topo: Topology
    plan: ExecutionPlan
    rng: RNGTracker
    chunks: list[GPTModel]  # one per virtual pipeline stage this rank holds
    data_parallel: DataParallel | FullyShardedDataParallel
    optimizer: MainParamOptimizer | FSDPOptimizer
    wgrad_store: WeightGradStore | None  # deferred (zero-bubble) or fused weight gradients
    p2p: P2P | None  # pp > 1
    _executors: dict[int, PipelineExecutor] = field(default_factory=dict, repr=False)

    @property
    def model(self) -> nn.ModuleList:
        return nn.ModuleList(self.chunks)

    def executor(self, microbatches: int) -> PipelineExecutor:
        """The executor of this rank's action list for a step of ``microbatches`` (one per count:
        a batch ramp-up passes through several)."""
        if microbatches not in self._executors:
            p = self.cfg.parallel
            actions = build_schedule(self.plan.schedule, p.pp, len(self.chunks), microbatches, self.topo.pp_rank)
            self._executors[microbatches] = PipelineExecutor(self.chunks, actions, self.p2p, p.pp,
                                                             self.topo.pp_rank, self.wgrad_store)
        return self._executors[microbatches]

    def capture_graphs(self) -> list[LayerGraphs]:
        """The layers' CUDA graphs where the plan graphs them (inside ``cuda_graphs.step_stream``,
        the stream the steps then run on); free them with ``cuda_graphs.release_all``."""
        if not self.plan.graphed:
            return []
        return graph_stage(self.chunks, self.cfg, self.data_parallel, fused=self.plan.fuse_wgrad)


def build_topology(cfg: Config, device: torch.device) -> Topology:
    """The rank grid and its process groups (after ``launch.init_distributed``; ``cfg`` validated)."""
    p = cfg.parallel
    if p.stage_tp:  # a grid per stage (validated: parallel.dp is the largest stage dp)
        return StageTopology.build_stages(p.stage_tp, p.stage_dp, device,
                                          timeout=datetime.timedelta(seconds=cfg.train.timeout_s))
    return Topology.build(tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, device=device,
                          timeout=datetime.timedelta(seconds=cfg.train.timeout_s))


def build_chunks(cfg: Config, topo: Topology, plan: ExecutionPlan, rng: RNGTracker | None) -> list[GPTModel]:
    """This rank's model chunks, initialised from the seed (the same full weights on any layout),
    with recomputation and compilation as the config and plan say."""
    p, t = cfg.parallel, cfg.train
    tp = TPContext(group=topo.group("tp"), sequence_parallel=p.sequence_parallel and topo.tp > 1, rng=rng, cp_group=topo.group("cp"),
                   fused_cross_entropy=plan.fused_cross_entropy, comm_overlap=plan.comm_overlap,
                   fused_elementwise=plan.fused_elementwise,
                   fp8=Float8Recipe(t.fp8) if t.fp8 != "none" else None,
                   fp8_cache=Float8WeightCache() if plan.fp8_weight_cache else None)
    chunks = build_stage_chunks(cfg.model, tp, topo.pp_rank, p.pp, p.vpp, list(plan.layout), topo.device)
    for chunk in chunks:
        chunk.init_weights(t.seed)
        if t.recompute != "none":
            chunk.recompute_layers = t.recompute_layers or len(chunk.layers)
            if t.recompute == "selective":  # ring attention's blocks are not kept (SelectivePolicy)
                chunk.recompute_policy = SelectivePolicy(attention=p.cp == 1)
        if plan.compiled:  # per layer: one graph reused by every layer of the same shape
            for layer in chunk.layers.values():
                layer.compile()
    return chunks


def build_data_parallel(chunks: list[GPTModel], topo: Topology, cfg: Config, fp8_gather: bool = False):
    """Data parallelism and the optimizer over ``chunks``: bucketed buffers with the mixed-precision
    / distributed optimizer (zero 0-2), or FSDP (zero 3; ``fp8_gather``: the fp8 linears' weights
    gathered in fp8, their scales dropped by every update and load of the weights)."""
    p, t = cfg.parallel, cfg.train
    if p.zero == 3:
        fsdp = FullyShardedDataParallel(chunks, topo, compute_dtype=DTYPES[t.dtype], fp8_gather=fp8_gather)
        optimizer = FSDPOptimizer(chunks, cfg.optim)
        if fsdp.fp8_scales is not None:
            optimizer.inner.register_step_post_hook(fsdp.fp8_scales.invalidate)
            optimizer.inner.register_load_state_dict_post_hook(fsdp.fp8_scales.invalidate)
        return fsdp, optimizer
    data_parallel = DataParallel(chunks, topo, zero=p.zero, param_dtype=DTYPES[t.dtype],
                                 grad_dtype=DTYPES[t.grad_dtype], bucket_size=p.bucket_size,
                                 overlap_grad_reduce=p.overlap_grad_reduce,
                                 overlap_param_gather=p.overlap_param_gather, embedding_group=topo.group("embedding"))
    return data_parallel, MainParamOptimizer(data_parallel, cfg.optim, offload=cfg.parallel.optimizer_offload,
                                             offload_staging=cfg.parallel.offload_staging)


def build(cfg: Config, topo: Topology, plan: ExecutionPlan | None = None,
          chunks: list[GPTModel] | None = None) -> Parts:
    """This rank's model chunks, data parallelism, optimizer and pipeline machinery for ``cfg``
    (checked by ``preflight.check_runnable``) on ``topo``, executed as ``plan`` says (by default
    the plan for the topology's device). ``chunks``: this rank's chunks from :func:`build_chunks`
    where the caller changes them first (e.g. freezes parameters)."""
    p, t = cfg.parallel, cfg.train
    validate(cfg, topo.world_size)  # (parallel.dp resolved; idempotent)
    plan = plan or make_plan(cfg, topo.device, topo.tp)
    if chunks is None:
        chunks = build_chunks(cfg, topo, plan, RNGTracker.for_rank(t.seed, topo.tp_rank, topo.pp_rank, topo.device))
    rng = chunks[0].tp.rng
    data_parallel, optimizer = build_data_parallel(chunks, topo, cfg, plan.fp8_param_gather)
    cache = chunks[0].tp.fp8_cache
    if cache is not None:  # the fp8 weight copies go stale with every update of the weights
        optimizer.inner.register_step_post_hook(cache.invalidate)
    store = None
    if plan.split_backward or plan.fuse_wgrad:  # weight gradients outside autograd, into the buffers
        sink = data_parallel if isinstance(data_parallel, DataParallel) else None  # (FSDP: refused by preflight)
        store = WeightGradStore(sink=sink, fuse=plan.fuse_wgrad)
        for chunk in chunks:
            chunk.use_weight_grad_store(store)
        if plan.compiled:  # compiled layers find their weights by storage, final now
            store.register(p for chunk in chunks for p in chunk.parameters())
    # every step's micro-batches have one shape, so the stages negotiate activation shapes once
    p2p = None
    if topo.heterogeneous:  # stages on grids of their own: the bridge re-splits what they exchange
        p2p = Bridge(topo, sequence_parallel=p.sequence_parallel, keep_shapes=True)
    elif p.pp > 1:
        p2p = P2P(topo, keep_shapes=True)
    return Parts(cfg=cfg, topo=topo, plan=plan, rng=rng, chunks=chunks, data_parallel=data_parallel,
                 optimizer=optimizer, wgrad_store=store, p2p=p2p)


__all__ = ["Parts", "build", "build_topology", "build_chunks", "build_data_parallel"]
