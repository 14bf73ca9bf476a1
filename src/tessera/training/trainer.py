"""The training loop that ties the stack together: config -> topology -> model -> data -> steps.

Order of construction (each piece receives what it needs explicitly):
topology -> RNG tracker -> stage (this rank's model chunks, TP-sharded, seeded full-matrix init;
the schedule, an executor per micro-batch count) -> data parallelism (buffers and buckets, or
FSDP) and the optimizer over its fp32 main parameters -> data (read on TP rank 0, broadcast
inside the TP group; the global batch may ramp up) -> steps -> metrics -> sample.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from tessera.checkpoint import Checkpointer, check_resume
from tessera.config import Config, ConfigError, can_graph_layers, to_dict, validate
from tessera.data import ByteTokenizer, microbatch_counts, sample_tokenizer
from tessera.data.tokenizer import file_tokenizer
from tessera.inference.generate import generate
from tessera.models import GPTModel, TPContext
from tessera.distributed.data_parallel import DataParallel
from tessera.distributed.fsdp import FullyShardedDataParallel
from tessera.distributed.memory import memory_report
from tessera.optim import DynamicLossScaler, LRScheduler, MicroBatchCalculator
from tessera.optim.optimizers import FSDPOptimizer, MainParamOptimizer
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.pipeline_parallel.p2p import P2P
from tessera.pipeline_parallel.schedules import SPLIT_BACKWARD, ScheduleError, build_all, build_schedule, check_kind
from tessera.pipeline_parallel.simulator import simulate
from tessera.pipeline_parallel.stage import NAMED, LayoutError, build_stage_chunks, parse_layout, stage_layer_ranges
from tessera.tensor_parallel import RNGTracker
from tessera.tensor_parallel.wgrad import WeightGradStore
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed
from tessera.training.evaluate import validation_loss
from tessera.training.flops import flops_per_token, peak_flops
from tessera.training.gc_control import GarbageCollection
from tessera.training.concurrent import PairedExecutor, graph_pairs
from tessera.training.cuda_graphs import graph_stage, release_all, step_stream
from tessera.training.launch import check_device, init_distributed, pick_device, world_from_env
from tessera.training.metrics import CHECKPOINT_LOCK_NAME, JsonlLogger, NullLogger, check_tensorboard, lock_out_dir
from tessera.training.rerun import LaunchedStep, NumericsGuard
from tessera.training.step import DTYPES, StepClock, train_step
from tessera.training.watchdog import StepWatchdog


def choose_schedule(kind: str, pp: int, vpp: int, microbatches: int, zero: int = 0) -> str:
    """``auto``: the fastest valid kind by the simulator (not ZB-H1 with zero >= 2: its deferred
    weight gradients keep zero=2's per-micro-batch buckets open, and arrive after FSDP reduced
    them; never zb-h2, which holds more micro-batches); at vpp > 1 interleaved-zb (zero < 2, the
    same reason), measured 6 % faster than interleaved at pp=2 (BENCHMARKS.md, session 9);
    otherwise ``kind``, checked."""
    if kind != "auto":
        check_kind(kind, pp, vpp, microbatches)
        return kind
    if pp == 1:
        return "none"
    if vpp > 1:
        return "interleaved" if zero >= 2 else "interleaved-zb"
    kinds = ("1f1b",) if zero >= 2 else ("1f1b", "zb-h1")
    return min(kinds, key=lambda k: simulate(build_all(k, pp, 1, microbatches)).step_time)


def check_datasets(data, vocab_size: int | None = None, validates: bool = False) -> None:
    """data.paths and data.split parse, every dataset opens (its files are whole), its training
    split (and with ``validates``, its validation split) holds a sample, the blend has one
    vocabulary, which fits ``vocab_size``."""
    from tessera.data import IndexedDataset, IndexedDatasetError, parse_blend, split_documents
    from tessera.data.indexed import document_ends, token_occurs

    try:
        blend = parse_blend(data.paths)
        split_documents(1000, data.split)
    except ValueError as e:
        if "split" in str(e):
            raise ConfigError("data.split", str(e), "give train, valid and test weights, e.g. data.split=969,30,1") from None
        raise ConfigError("data.paths", str(e), "give one prefix, or weights and prefixes, "
                          "e.g. data.paths=0.7,prefixA,0.3,prefixB") from None
    packing = data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss
    for _, prefix in blend:
        try:
            dataset = IndexedDataset(prefix)
            lengths = dataset.sequence_lengths
        except IndexedDatasetError as e:
            raise ConfigError("data.paths", str(e), "preprocess the data with `tessera preprocess`, or fix the path") from None
        if packing:  # a wrong data.eod_id packs nothing apart, or cuts documents at an ordinary token
            ends = document_ends(dataset)
            if ends and data.eod_id not in ends and (len(ends) == 1 or not token_occurs(dataset, data.eod_id)):
                said = f"they all end with {next(iter(ends))}" if len(ends) == 1 else "they end with no one id"
                raise ConfigError("data.eod_id", f"{data.eod_id}, but no document sampled from {prefix} ends with "
                                  f"it ({said})", f"set data.eod_id={next(iter(ends))}, the id preprocessing appended"
                                  if len(ends) == 1 else "give the id that ends each document, or preprocess the data "
                                  "with `tessera preprocess` (it appends one)")
        parts = split_documents(len(lengths), data.split)
        for part, name in ((0, "training"), (1, "validation"))[:2 if validates else 1]:
            docs = parts[part]
            if int(lengths[docs.start:docs.stop].sum(dtype="int64")) < 2:
                raise ConfigError("data.split", f"{data.split} leaves {prefix}'s {name} part documents {docs.start} to "
                                  f"{docs.stop} of {len(lengths)}, with too few tokens for a sample",
                                  f"give the {name} part more weight (data.split is train,valid,test), "
                                  f"or more documents" + (", or set train.eval_every=0" if part else ""))
    check_data_tokenizers([prefix for _, prefix in blend], vocab_size)


def check_data_tokenizers(prefixes: list[str], vocab_size: int | None) -> None:
    """Where datasets have their ``PREFIX.tokenizer.json`` (written by ``tessera preprocess``;
    datasets made elsewhere are not checked): ``vocab_size`` holds its ids (found otherwise only
    when a rank reads such an id), and a blend shares one vocabulary (the same id would mean other
    text in each)."""
    seen: dict[str, dict[str, int]] = {}
    for prefix in prefixes:
        path = f"{prefix}.tokenizer.json"
        if not os.path.isfile(path):
            continue
        tokenizer = file_tokenizer(path, "data.paths", "preprocess the dataset again, or remove the broken file")
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ConfigError("model.vocab_size", f"{vocab_size} is smaller than the {tokenizer.vocab_size} ids of "
                              f"{path}, the data's tokenizer", f"set model.vocab_size >= {tokenizer.vocab_size}")
        vocabulary = tokenizer.vocabulary()
        for other, theirs in seen.items():
            if theirs != vocabulary:
                raise ConfigError("data.paths", f"the blend's datasets have different vocabularies: {other}.tokenizer.json "
                                  f"and {path} differ (an id would mean other text in each)",
                                  f"preprocess them with one tokenizer, e.g. --tokenizer {other}.tokenizer.json")
        seen[prefix] = vocabulary


def step_microbatch_counts(cfg: Config) -> list[int]:
    """Every per-rank micro-batch count the run's steps will use (several during a ramp-up)."""
    return microbatch_counts(MicroBatchCalculator.from_config(cfg.train, cfg.parallel.dp), cfg.train.steps)


def check_runnable(cfg: Config, world_size: int) -> Config:
    """Every check that can refuse the run, done before any process group or model exists."""
    validate(cfg, world_size)
    p, m, t = cfg.parallel, cfg.model, cfg.train
    try:
        stage_layer_ranges(m.layers, p.pp, p.vpp, parse_layout(p.pp_layout, m, p.pp, p.vpp))
    except LayoutError as e:
        named = p.pp_layout.strip().lower() in NAMED
        stages = p.pp * p.vpp
        fix = ("change parallel.pp / parallel.vpp, or set parallel.pp_layout=balanced or a list" if named else
               f"give {stages} layer counts (one per virtual stage, pp*vpp) that sum to model.layers={m.layers}, "
               "or set parallel.pp_layout=balanced")
        if named and stages > m.layers:  # (no named layout gives more virtual stages than layers)
            fix = f"use at most model.layers={m.layers} virtual stages: lower parallel.pp / parallel.vpp"
        raise ConfigError("parallel.pp_layout" if not named else "parallel.vpp" if p.vpp > 1 else "parallel.pp",
                          str(e), fix) from None
    microbatches = t.global_batch // (t.micro_batch * p.dp)
    count = microbatches
    try:
        kind = choose_schedule(p.schedule, p.pp, p.vpp, microbatches, p.zero)
        for count in step_microbatch_counts(cfg):  # every count a batch ramp-up passes through
            check_kind(kind, p.pp, p.vpp, count)
            simulate(build_all(kind, p.pp, p.vpp, count), p.vpp)  # proves it cannot hang
    except ScheduleError as e:
        raise ConfigError("parallel.schedule", f"{e} (with {count} micro-batches per step)",
                          "choose another parallel.schedule, or change parallel.pp / vpp / train.global_batch"
                          " / train.batch_rampup") from None
    LRScheduler(cfg.optim, t.steps)  # refuses a wsd decay longer than the steps after warmup
    if cfg.data.source == "indexed":
        check_datasets(cfg.data, m.vocab_size, validates=t.eval_every > 0)
    if cfg.data.source == "builtin" and t.eval_every:
        import pydoc_data.topics  # (the demo corpus: one document per topic)

        from tessera.data import split_documents
        if not split_documents(len(pydoc_data.topics.topics), cfg.data.split)[1]:
            raise ConfigError("data.split", f"{cfg.data.split} leaves the builtin corpus's "
                              f"{len(pydoc_data.topics.topics)} documents no validation part",
                              "give the validation part more weight (data.split is train,valid,test, e.g. 90,10,0), "
                              "or set train.eval_every=0")
    if cfg.data.cache_dir and cfg.data.source != "synthetic":
        _check_writable_dir(cfg.data.cache_dir, "data.cache_dir")
    elif cfg.data.source == "indexed":  # the default: an index-cache folder beside each dataset
        from tessera.data import parse_blend
        from tessera.data.indexed_source import index_cache_beside
        for _, prefix in parse_blend(cfg.data.paths):
            cache = index_cache_beside(prefix)
            if not os.path.isdir(cache):  # (one there already may hold the indices: read, not written)
                try:
                    _check_writable_dir(cache, "data.cache_dir")
                except ConfigError as e:
                    raise ConfigError("data.cache_dir", f"empty, so the sample indices go beside {prefix}: {e.problem}",
                                      "set data.cache_dir to a folder you can write") from None
    if cfg.data.source == "builtin" and m.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the byte "
                          f"tokenizer's {ByteTokenizer.vocab_size} ids of the builtin corpus",
                          "set model.vocab_size >= 256")
    if t.sample_tokens:
        sample_tokenizer(t.sample_tokenizer, cfg.data, m.vocab_size, t.sample_prompt)
    _check_writable_dir(t.out_dir, "train.out_dir")
    if t.tensorboard:
        check_tensorboard()
    if cfg.checkpoint.dir:
        _check_writable_dir(cfg.checkpoint.dir, "checkpoint.dir")
    check_resume(cfg)
    check_device(t.device, t.cuda_graphs)
    return cfg


def _check_writable_dir(path: str, key: str) -> None:
    """``path``, or the nearest folder above it that exists, is a directory this process may write."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(key, f"{existing} is a file, not a directory ({key}={path})", "give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{existing} is not writable ({key}={path})", "give a directory you can write")


def fast_paths(cfg: Config, schedule: str, device: torch.device) -> tuple[bool, bool, bool]:
    """(compiled layers, gradient-accumulation fusion, CUDA-graphed layers): train.compile,
    train.grad_accum_fusion and train.cuda_graphs resolved. Explicit choices stand (compile and
    fusion together: the fused linear layers run eagerly between compiled pieces). auto picks
    what measured fastest on H100 (BENCHMARKS.md, sessions 4-6):
    - tp=1: compiled layers for the llama family (RMSNorm, RoPE and SwiGLU run as many small
      kernels in eager mode: +10% on Llama-1B over fused eager layers), with fused weight
      gradients inside them (opaque ops in the layer's one graph since session 14: 62,988 against
      59,998 tokens/s without, 61,750 for eager layers with fusion and the compiled elementwise
      functions, Llama-1B on H100, session 16), fused weight gradients in
      eager layers elsewhere (+2% over compiled layers on GPT-1.3B); never compiled layers around
      a split-backward schedule's deferred weight gradients (with the deferrable linear layers as
      opaque ops in the layer's one graph, Llama-1B pp=2 vpp=2 ran 0.863 of one GPU against 0.920
      for eager layers with the compiled elementwise functions, train.fused_elementwise, session 15).
    - tp > 1: CUDA-graphed eager layers where they can be captured (config.can_graph_layers):
      the halved GEMMs leave the step bound by the host's launch time, and graphs measured +67%
      at tp=2 (40,370 against 24,223 tokens/s), also with the opt-in overlapped TP paths under
      sequence parallelism (parallel.tp_async, tp_comm_overlap) and tp_comm_overlap without SP (an
      overlapped all-reduce): graphed, each follows one GPU (GPU test); the async TP paths run
      within 3 % of the plain graphed layers (the backward comm overlap 1.6-2.6 % faster: auto
      turns it on with graphed layers, tp_comm_overlap), while eager they are far slower (symmetric-memory
      async TP 12,206 eager against 41,315 graphed, session 8). Not fusion (in eager layers 15%
      slower at tp=2: it adds Python work per linear layer; train.grad_accum_fusion=true captures
      the fused GEMMs in the graphs, opt-in until measured: the fused fp32-accumulating fc1
      weight-gradient GEMM took 102 us against 125 us for GEMM + add_, session 10), nor compiled
      layers (correct since the collectives became opaque ops, but slower than eager at tp=2:
      19,184 against 21,686). Also under zero 1/2's overlapped parameter gather at dp > 1 (its
      hooks lifted for the capture): graphed, zero 1, zero 2 and zero 1 with fused weight
      gradients follow one GPU (test_cuda_graphed_layers_under_the_overlapped_gather_follow_one_gpu,
      passed on 2x H200 in session 12).
    Nothing on CPU."""
    t, p, cuda = cfg.train, cfg.parallel, device.type == "cuda"
    if t.cuda_graphs == "auto":
        graphs = cuda and p.tp > 1 and t.compile != "true" and can_graph_layers(cfg)
    else:
        graphs = t.cuda_graphs == "true"
    if t.compile == "auto":
        compiled = (cuda and p.tp == 1 and cfg.model.family == "llama" and schedule not in SPLIT_BACKWARD
                    and not graphs and t.recompute == "none")
    else:
        compiled = t.compile == "true"
    if t.grad_accum_fusion == "auto":
        # in compiled layers only where auto compiled them (measured for llama; GPT's compiled
        # layers with fusion were never measured against its eager fused default)
        fuse = cuda and p.tp == 1 and p.zero < 3 and not graphs and (not compiled or t.compile == "auto")
    else:
        fuse = t.grad_accum_fusion == "true"
    return compiled, fuse, graphs


def fused_elementwise(cfg: Config, compiled: bool, device: torch.device) -> bool:
    """train.fused_elementwise resolved: whether llama's RMSNorm, RoPE and SwiGLU run as compiled
    functions (models/fused.py). Never on a CPU or inside compiled layers (which fuse them
    already); otherwise on unless set false: in eager layers they measured +11 % at pp=2 vpp=2,
    in CUDA-graphed layers +8.8 % at tp=2 + SP (Llama-1B, BENCHMARKS.md session 15)."""
    return (device.type == "cuda" and not compiled and cfg.model.family == "llama"
            and cfg.train.fused_elementwise != "false")


def tp_comm_overlap(cfg: Config, graphed: bool) -> bool:
    """parallel.tp_comm_overlap resolved: auto overlaps the backward's TP collectives with the
    weight-gradient GEMMs inside CUDA-graphed layers at tp > 1, where it measured faster, and not
    around eager or compiled layers (BENCHMARKS.md sessions 4, 7, 14)."""
    p = cfg.parallel
    return {"true": True, "false": False}.get(p.tp_comm_overlap, graphed and p.tp > 1)


def microbatch_pairs(cfg: Config) -> bool:
    """parallel.tp_microbatch_pairs resolved (true was validated by config): only true runs
    pairs. auto ran them around CUDA-graphed layers at tp > 1 (+13.7 % on GPT-1.3B, +8.3 % on
    Llama-1B at tp=2 + SP, session 18) until session 19 saw 4 of 19 GPT-1.3B tp=2 + SP runs hang
    (benchmarks/pairs_ab.py; the two communicators' collectives in flight at once, which NCCL
    documents may deadlock): a step that may hang is no default (training/concurrent.py)."""
    return cfg.parallel.tp_microbatch_pairs == "true"


class Stage:
    """This rank's share of the model and how it runs a step of ``m`` micro-batches."""

    def __init__(self, cfg: Config, topo: Topology, rng: RNGTracker | None):
        p = cfg.parallel
        self.cfg, self.pp, self.pp_rank, self.rng = cfg, p.pp, topo.pp_rank, rng
        self.schedule = choose_schedule(p.schedule, p.pp, p.vpp, self.microbatches(cfg.train.global_batch, topo.dp),
                                        p.zero)
        self.compiled, self.fuse_wgrad, self.graphed = fast_paths(cfg, self.schedule, topo.device)
        self.wgrad_store = WeightGradStore() if self.schedule in SPLIT_BACKWARD or self.fuse_wgrad else None
        self.comm_overlap = tp_comm_overlap(cfg, self.graphed)
        self.elementwise_compiled = fused_elementwise(cfg, self.compiled, topo.device)
        tp = TPContext(group=topo.group("tp"), sequence_parallel=p.sequence_parallel, rng=rng,
                       wgrad_store=self.wgrad_store, fused_cross_entropy=None if cfg.train.fused_cross_entropy else False,
                       comm_overlap=self.comm_overlap, fused_elementwise=self.elementwise_compiled,
                       async_tp={"false": False, "true": True, "p2p": "p2p"}[p.tp_async])
        layout = parse_layout(p.pp_layout, cfg.model, p.pp, p.vpp)
        # layers per virtual stage, for the run's first line (auto's choice made visible)
        self.layout = [len(r) for r in stage_layer_ranges(cfg.model.layers, p.pp, p.vpp, layout)]
        self.chunks = build_stage_chunks(cfg.model, tp, topo.pp_rank, p.pp, p.vpp, layout,
                                         topo.device)
        for chunk in self.chunks:
            chunk.init_weights(cfg.train.seed)
            if cfg.train.recompute == "full":
                chunk.recompute_layers = cfg.train.recompute_layers or len(chunk.layers)
            if self.compiled:  # per layer: one graph reused by every layer of the same shape
                for layer in chunk.layers.values():
                    layer.compile()
        self.model = nn.ModuleList(self.chunks)
        # DataFeed gives every step's micro-batches one shape, so the stages negotiate the
        # activation shapes once: later steps' receives never make the host wait (p2p.py)
        self.p2p = P2P(topo, keep_shapes=True) if p.pp > 1 else None
        # micro-batch pairs (training/concurrent.py): the second of each on a side stream with a TP
        # communicator of its own (made on every rank alike: the config is the same everywhere)
        self.pairs = microbatch_pairs(cfg)
        self.first_tp = topo.group("tp")
        self.second_tp = topo.new_groups(topo.all_ranks_along("tp")) if self.pairs else None
        self._paired = None
        if self.pairs:  # zero 1/2's overlapped gather waits in the step's first forward
            side = torch.cuda.Stream(topo.device) if topo.device.type == "cuda" else None
            gathers = p.zero in (1, 2) and p.overlap_param_gather and topo.dp > 1
            self._paired = PairedExecutor(self.chunks[0], self.first_tp, self.second_tp, side,
                                          gathers_in_forward=gathers, concurrent_backward=p.zero != 2)
            self._paired.backward_in_turn = p.tp_pairs_backward == "in_turn"
        self._executors: dict[int, PipelineExecutor] = {}

    def capture_graphs(self, data_parallel) -> list:
        """The layers' CUDA graphs as ``train`` takes them (inside ``cuda_graphs.step_stream``,
        after data parallelism placed the parameters; free them with ``release_all``): one set,
        or one per TP communicator for micro-batch pairs; none where the layers are not graphed."""
        if not self.graphed:
            return []

        def capture():
            return graph_stage(self.chunks, self.cfg, data_parallel, fused=self.fuse_wgrad)
        return graph_pairs(self.chunks, capture, self.first_tp, self.second_tp) if self.pairs else capture()

    def microbatches(self, global_batch: int, dp: int) -> int:
        return global_batch // (self.cfg.train.micro_batch * dp)

    def executor(self, m: int) -> PipelineExecutor | PairedExecutor:
        """The executor of this rank's action list for ``m`` micro-batches (one per count), or
        the one that runs them in pairs."""
        if self._paired is not None:
            return self._paired
        if m not in self._executors:
            actions = build_schedule(self.schedule, self.pp, len(self.chunks), m, self.pp_rank)
            self._executors[m] = PipelineExecutor(self.chunks, actions, self.p2p, self.pp, self.pp_rank,
                                                  self.wgrad_store)
        return self._executors[m]


def build_data_parallel(stage: Stage, topo: Topology, cfg: Config):
    """Data parallelism and the optimizer for this rank's chunks: bucketed buffers with a
    mixed-precision / distributed optimizer (zero 0-2), or FSDP (zero 3)."""
    p, t = cfg.parallel, cfg.train
    if p.zero == 3:
        data_parallel = FullyShardedDataParallel(stage.chunks, topo, compute_dtype=DTYPES[t.dtype])
        return data_parallel, FSDPOptimizer(stage.chunks, cfg.optim)
    data_parallel = DataParallel(stage.chunks, topo, zero=p.zero, param_dtype=DTYPES[t.dtype],
                                 grad_dtype=DTYPES[t.grad_dtype], bucket_size=p.bucket_size,
                                 overlap_grad_reduce=p.overlap_grad_reduce,
                                 overlap_param_gather=p.overlap_param_gather, wgrad_store=stage.wgrad_store,
                                 reduce_dtype=DTYPES[p.grad_reduce_dtype], fuse_wgrad=stage.fuse_wgrad,
                                 embedding_group=topo.group("embedding"))
    if stage.compiled and stage.wgrad_store is not None:  # their storage is final now
        stage.wgrad_store.register(stage.model.parameters())
    if stage.pairs:  # the pairs' second backward adds on its own stream (training/concurrent.py)
        stage._paired.data_parallel = data_parallel
    return data_parallel, MainParamOptimizer(data_parallel, cfg.optim)


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
    logs = topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0
    # rank 0 holds checkpoint.dir (it renames checkpoints into place), the logging rank out_dir
    held = lock_out_dir(cfg.checkpoint.dir, "checkpoint.dir", CHECKPOINT_LOCK_NAME) \
        if cfg.checkpoint.dir and rank == 0 else None
    try:
        logger = JsonlLogger(t.out_dir, t.log_every, config=to_dict(cfg), tensorboard=t.tensorboard) \
            if logs else NullLogger()  # (takes out_dir's lock)
        try:
            return _build_and_run(cfg, topo, device, logger, logs, world)
        finally:
            logger.close()
    finally:
        if held is not None:
            held.close()


def _build_and_run(cfg: Config, topo: Topology, device: torch.device, logger, logs: bool, world: int) -> list[dict]:
    p, t = cfg.parallel, cfg.train
    rng = RNGTracker.for_rank(t.seed, topo.tp_rank, topo.pp_rank, device)
    stage = Stage(cfg, topo, rng)
    model = stage.model
    data_parallel, optimizer = build_data_parallel(stage, topo, cfg)
    n_params, whole = sum(p.numel() for p in model.parameters()), 0
    if logs:
        with torch.device("meta"):  # the whole model's count (no memory: meta tensors)
            whole = sum(p.numel() for p in GPTModel(cfg.model).parameters())
    logger.print(f"tessera: {cfg.model.family} with {whole:,} parameters, {n_params:,} on this rank, "
                 f"{topo!r}, schedule {stage.schedule}"
                 f"{f' (layers per stage {stage.layout}, pp_layout={p.pp_layout})' if p.pp > 1 else ''}, zero={p.zero}, "
                 f"device {device}, {t.dtype}, "
                 f"layers {'compiled' if stage.compiled else 'eager'}{' in CUDA graphs' if stage.graphed else ''}, "
                 f"weight gradients {'fused into main_grad' if stage.fuse_wgrad else 'via autograd'}"
                 f"{f' (deferred, {stage.schedule})' if stage.schedule in SPLIT_BACKWARD else ''}"
                 f"{', TP backward comm overlapped' if stage.comm_overlap and p.tp > 1 else ''}"
                 f"{', micro-batches in pairs on two streams (experimental: may hang, training/concurrent.py)' if stage.pairs else ''}"
                 f"{', RMSNorm / RoPE / SwiGLU compiled' if stage.elementwise_compiled else ''}")
    logger.print(str(memory_report(data_parallel, optimizer)))

    model.train()
    # captured after data parallelism placed the parameters in their buffers, on the stream the
    # steps then run on (cuda_graphs.step_stream)
    with step_stream(device) if stage.graphed else contextlib.nullcontext():
        graphs = stage.capture_graphs(data_parallel)
        try:
            checkpointer = Checkpointer(cfg, topo, stage.chunks, data_parallel, optimizer, rng, logger.print)
            return _run(cfg, topo, stage, data_parallel, optimizer, logger, logs, world, device, checkpointer)
        finally:  # a graph holding NCCL work would hang destroy_process_group
            release_all(graphs)


def _due(done: int, every: int, steps: int) -> bool:
    """Whether work done every ``every`` steps (0: never) and after the last is due after step ``done``."""
    return every > 0 and (done % every == 0 or done == steps)


def _resume(cfg: Config, checkpointer: Checkpointer, scheduler, data, scaler, logger, guard) -> int:
    """Load the checkpoint the run starts from, if any (checked before the launch already; the
    same answer on every rank); the step to go on from."""
    resume = check_resume(cfg)
    if resume is None:
        return 0
    began = time.perf_counter()
    start, streams = checkpointer.load(resume["path"], scheduler, data, scaler, resume["weights_only"], guard)
    saved_at = " ".join(f"{k}={v}" for k, v in resume["layout"].items())
    if resume["weights_only"]:
        logger.print(f"tessera: starting from the weights of {resume['path']} (saved at {saved_at}; "
                     f"checkpoint.finetune: Adam, step, data and schedules afresh) in {time.perf_counter() - began:.1f} s")
    else:
        logger.print(f"tessera: resumed from {resume['path']} at step {start} in {time.perf_counter() - began:.1f} s "
                     f"(saved at {saved_at}; random streams "
                     f"{'restored' if streams else 'seeded anew: another layout or no dropout streams'}"
                     f"{'; the schedule of this run, checkpoint.new_schedule' if cfg.checkpoint.new_schedule else ''})")
    saved = resume["config"].get("data", {})
    changed = [f"data.{k}: {saved[k]!r} -> {getattr(cfg.data, k)!r}" for k in ("source", "paths")
               if k in saved and saved[k] != getattr(cfg.data, k)]
    if changed and not resume["weights_only"]:  # (allowed: a deliberate switch of data mid-run)
        logger.print(f"tessera: the data differs from the checkpoint's ({'; '.join(changed)}): training goes on "
                     f"with the new data from the checkpoint's position in it")
    if start == cfg.train.steps:
        logger.print(f"tessera: the checkpoint is at train.steps = {start}: nothing to train "
                     "(raise train.steps to train on)")
    return start


def _run(cfg: Config, topo: Topology, stage: Stage, data_parallel, optimizer, logger, logs: bool, world: int,
         device: torch.device, checkpointer: Checkpointer) -> list[dict]:
    """The training loop (from a checkpoint's step, if the run resumes), then the sample."""
    t, model, history = cfg.train, stage.model, []
    scheduler = LRScheduler(cfg.optim, t.steps)
    scaler = DynamicLossScaler() if t.dtype == "fp16" else None
    data = DataFeed(cfg, topo)
    valid = DataFeed(cfg, topo, split=1) if t.eval_every else None
    guard = NumericsGuard(t, device, dist.get_rank() if dist.is_initialized() else 0, fp16=scaler is not None,
                          knows_loss=topo.is_last_stage, checkpoints=bool(cfg.checkpoint.dir))
    start = _resume(cfg, checkpointer, scheduler, data, scaler, logger, guard)
    per_token, peak = flops_per_token(cfg.model), peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def speed(tokens: int, elapsed: float) -> dict:
        """Model TFLOP/s per GPU (training/flops.py), MFU where the card's peak is known, and
        this rank's peak memory."""
        flops = per_token * tokens / elapsed / world
        out = {"tflops_per_gpu": flops / 1e12}
        if peak:
            out["mfu"] = flops / peak
        if device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return out

    def rerun(launched: LaunchedStep):
        """Step ``launched`` again, on its batch and random streams (training/rerun.py: the
        weights are still the ones it ran on)."""
        if launched.rng_states is not None:
            stage.rng.set_states(launched.rng_states)
        guard.launching(launched.step, rerunning=True)
        return train_step(optimizer, launched.micro_batches, topo, stage.executor(len(launched.micro_batches)),
                          data_parallel, clip_grad=cfg.optim.clip_grad, scaler=scaler, guard=guard)

    def log(launched: LaunchedStep, lr: float, decay: float, scale: float | None, result, processed: int,
            check: bool = True) -> None:
        """``tokens``: the tokens the loss averaged over (loss mask applied); throughput and
        FLOPs count every token the model processed (``processed``: global batch x seq_len),
        as Megatron's do. Then the guard's verdict on a non-finite step (it may stop the run)."""
        done = launched.step
        tokens = result.tokens  # waits for that step's GPU work
        elapsed = clock.lap(result)
        metrics = {"step": done + 1, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
                   "weight_decay": decay, "tokens_per_s": processed / elapsed, "tokens": tokens,
                   "step_time_s": elapsed, **speed(processed, elapsed), "skipped": result.skipped}
        if scaler is not None:
            metrics.update(loss_scale=scale)
        if done in collected:  # train.gc_interval: the collection run after this step's launch
            metrics["gc_ms"] = collected.pop(done)
        if done in validated:  # train.eval_every: the validation loss after this step
            loss = validated.pop(done)
            metrics.update(valid_loss=loss, valid_ppl=math.exp(loss) if loss < 700 else float("inf"))
        logger.log(metrics)
        if logs:
            history.append(metrics)
        if check:  # (not while another error ends the run: the re-run's collectives would wait for ranks that left)
            guard.check(launched, result, rerun, logger.print)

    # Step k's figures are read after step k+1 is launched (training/step.py), so the host never
    # leaves the GPU idle between steps; a step's time is where its work ran (StepClock).
    pending, clock, collected, validated = None, StepClock(device), {}, {}
    with checkpointer.finishing(), GarbageCollection(t.gc_interval) as collector, StepWatchdog(t.timeout_s) as watchdog:
        for step in range(start, t.steps):
            watchdog.tick()  # a step that hangs ends the job with every thread's stack (training/watchdog.py)
            try:
                lr, scale = scheduler.apply(optimizer, step), scaler.scale if scaler is not None else None
                first = data.batches.consumed_samples
                processed = data.batches.global_batch(first) * cfg.model.seq_len
                micro_batches = data.next()
                launched = LaunchedStep(step, micro_batches, stage.rng.get_states() if stage.rng is not None else None,
                                        (first, data.batches.consumed_samples))
                guard.launching(step)
                result = train_step(optimizer, micro_batches, topo, stage.executor(len(micro_batches)),
                                    data_parallel, clip_grad=cfg.optim.clip_grad, scaler=scaler, guard=guard)
            except BaseException:
                if pending is not None:  # the last good step's line, if its figures can still be read
                    with contextlib.suppress(Exception):
                        log(*pending, check=False)
                raise
            if pending is not None:
                log(*pending)
            pending = (launched, lr, scheduler.weight_decay(step), scale, result, processed)  # the scale the step ran with
            ms = collector.step(step)
            if ms is not None:
                collected[step] = ms
            if _due(step + 1, t.eval_every, t.steps):
                with watchdog.paused():
                    data_parallel.wait_param_gather()  # (zero 1/2: the updated parameters; also where graphs lifted the hooks)
                    loss = validation_loss(stage.chunks, topo, valid, t.eval_batches, stage.p2p)
                if loss is not None:
                    validated[step] = loss
                clock.restart(after=result)  # (the next step's time is its own)
            if cfg.checkpoint.dir and (_due(step + 1, cfg.checkpoint.save_every, t.steps) or step + 1 == t.steps):
                log(*pending)  # (read first: a non-finite step stops the run before it is saved)
                pending = None
                with watchdog.paused():  # (a large model's save may rightly take minutes)
                    checkpointer.save(step + 1, scheduler, data, scaler, guard)
                clock.restart(after=result)  # (the next step's time is its own)
        watchdog.tick()
        if pending is not None:
            log(*pending)
    checkpointer.wait()  # a background save's last write (not under the step watchdog)
    logger.print_last()

    data_parallel.wait_param_gather()
    if device.type == "cuda" and world > 1:
        # the metrics carry the logging rank's peak only (the last stage); another rank may hold
        # more (a pipeline's first stage keeps the most micro-batches in flight): one gather, at the end
        peaks = [None] * world
        dist.all_gather_object(peaks, round(torch.cuda.max_memory_allocated(device) / 2**30, 2))
        logger.print(f"peak memory per rank (GiB): {peaks}")
    if t.sample_tokens:
        tokenizer = sample_tokenizer(t.sample_tokenizer, cfg.data, cfg.model.vocab_size, t.sample_prompt)
        ids = generate(list(model), tokenizer.encode(t.sample_prompt), t.sample_tokens, topo=topo,
                       p2p=stage.p2p, seed=t.seed)
        logger.print("sample: " + tokenizer.decode(ids))
    return history


__all__ = ["train", "check_runnable", "to_dict"]
