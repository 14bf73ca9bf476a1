"""The memory a layout needs per rank, predicted before anything is built (docs/architecture.md, Memory).

    peak(rank) = model state + max over the step of (activations held + the transient of the work in hand)

- **Model state** (:func:`model_state`): parameters, gradients, fp32 main parameters and Adam's two
  moments, computed the way the trainer lays them out: this rank's parameters (its pipeline
  chunks, TP slices) in data parallelism's flat buffers, back to front, cut into buckets padded to
  multiples of 64 x dp (zero 0-2; the optimizer's shard of each bucket at zero 1-2), or FSDP's
  dim-0 shards (zero 3). It equals :func:`tessera.distributed.memory.memory_report` to the byte.
  The per-parameter table (``distributed/memory.py``) is the same without padding. With
  ``parallel.optimizer_offload`` the main parameters (an fp32 model's too), Adam's moments and
  the two gradient staging buffers (``optim/offload.py``) are host bytes (``MemoryReport.host``),
  outside the device's total.
- **Activations**: ``models/activations.py`` per micro-batch and layer, for the layer's recompute
  mode (the first ``recompute_layers`` of each chunk), plus the embedding and the head on the first
  and last stages. The pipeline schedule says how many micro-batch chunks a rank holds at once:
  its compute actions are walked in order (an F adds the chunk's activations, a B or I frees them,
  an I leaves the linear layers' inputs and output gradients until its W), so every schedule's
  peak, zero-bubble's deferred weight gradients and uneven chunks included, is what its own lists
  give (the order of a rank's actions does not depend on timing). cp divides the tokens.
- **Temporaries**, on top of what is held when they happen: one logits-sized tensor of the loss
  (the head holds the logits or the fp32 softmax; the transient is the 16-bit logits beside that
  copy, or the logits' gradient), a layer's backward (what a recomputed layer rebuilds,
  and the gradients of its two widest tensors), FSDP's gathered layer (two in the compute dtype,
  the one being computed and the prefetched next, the fp8 linears' weights at a byte where FSDP
  gathers them in fp8, and an fp32 gradient), zero=2's two bucket
  gradient buffers in flight; the tensorwise fp8 weight cache of eager layers (a byte per element
  of each fp8 linear's weight), held from a step's first forward to its update.

Not counted: the CUDA context, NCCL's buffers, the allocator's fragmentation (``tessera plan``
keeps a headroom for them), CUDA graphs' pools, compiled code's workspaces.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, fields

from tessera.config import Config, ModelConfig
from tessera.distributed.memory import MemoryReport
from tessera.models.activations import DTYPE_BYTES, Activations
from tessera.optim.offload import staging_buffers, staging_spans
from tessera.pipeline_parallel.schedules import Op, compute_order
from tessera.pipeline_parallel.stage import parse_layout, stage_layer_ranges
from tessera.tensor_parallel.layers import padded_vocab_size
from tessera.training.plan import ExecutionPlan, microbatches

ALIGN = 64  # distributed/buffers.py: each parameter starts on a multiple, each bucket pads to ALIGN * dp


@dataclass(frozen=True)
class Param:
    """One parameter of a rank's chunk: its element count, rows (dim 0, which FSDP shards) and
    whether it is a tied embedding copy (a bucket of its own)."""

    name: str
    numel: int
    rows: int
    alone: bool = False


def chunk_parameters(m: ModelConfig, tp: int, layers: range, pre: bool, post: bool) -> list[Param]:
    """A model chunk's trainable parameters as ``GPTModel`` registers them (this TP rank's slices)."""
    return list(_chunk_parameters(_model_key(m), tp, layers.start, layers.stop, pre, post))


def _model_key(m: ModelConfig) -> tuple:
    return tuple(getattr(m, f.name) for f in fields(m))


@functools.lru_cache(maxsize=1024)  # (tessera plan asks for the same chunks of many layouts)
def _chunk_parameters(key: tuple, tp: int, first: int, stop: int, pre: bool, post: bool) -> tuple[Param, ...]:
    m = ModelConfig(**dict(zip((f.name for f in fields(ModelConfig)), key)))
    layers = range(first, stop)
    h, d, f, gpt2 = m.hidden, m.head_dim, m.ffn_size, m.family == "gpt2"
    vocab = padded_vocab_size(m.vocab_size, tp, m.vocab_pad_multiple) // tp

    def linear(name: str, rows: int, cols: int, bias_rows: int | None) -> list[Param]:
        out = [Param(f"{name}.weight", rows * cols, rows)]
        return out + ([Param(f"{name}.bias", bias_rows, bias_rows)] if gpt2 else [])

    def norm(name: str) -> list[Param]:
        return [Param(f"{name}.weight", h, h)] + ([Param(f"{name}.bias", h, h)] if gpt2 else [])

    out = []
    if pre:
        out.append(Param("embedding.weight", vocab * h, vocab, alone=m.tie_embeddings and not post))
        if gpt2:
            out.append(Param("pos_embedding.weight", m.seq_len * h, m.seq_len))
    for i in layers:
        qkv = (m.heads + 2 * m.num_kv_heads) * d // tp
        ffn1 = (1 if gpt2 else 2) * f // tp
        out += norm(f"layers.{i}.attn_norm") + linear(f"layers.{i}.attn.qkv", qkv, h, qkv)
        out += linear(f"layers.{i}.attn.proj", h, m.heads * d // tp, h) + norm(f"layers.{i}.mlp_norm")
        out += linear(f"layers.{i}.mlp.fc1", ffn1, h, ffn1) + linear(f"layers.{i}.mlp.fc2", h, f // tp, h)
    if post:
        out += norm("final_norm")
        if not (m.tie_embeddings and pre):
            out.append(Param("output.weight", vocab * h, vocab, alone=m.tie_embeddings))
    return tuple(out)


def rank_chunks(cfg: Config, pp_rank: int) -> list[tuple[int, range]]:
    """(virtual stage, its global layers) of each chunk ``pp_rank`` holds."""
    p = cfg.parallel
    ranges = _stage_ranges(_model_key(cfg.model), p.pp, p.vpp, p.pp_layout)
    return [(c * p.pp + pp_rank, ranges[c * p.pp + pp_rank]) for c in range(p.vpp)]


@functools.lru_cache(maxsize=256)
def _stage_ranges(key: tuple, pp: int, vpp: int, layout: str) -> list[range]:
    m = ModelConfig(**dict(zip((f.name for f in fields(ModelConfig)), key)))
    return stage_layer_ranges(m.layers, pp, vpp, parse_layout(layout, m, pp, vpp))


def rank_parameters(cfg: Config, pp_rank: int) -> list[list[Param]]:
    """Each of this pipeline rank's chunks' parameters."""
    p, last = cfg.parallel, cfg.parallel.pp * cfg.parallel.vpp - 1
    return [chunk_parameters(cfg.model, p.tp, layers, stage == 0, stage == last)
            for stage, layers in rank_chunks(cfg, pp_rank)]


def _buckets(params: list[Param], bucket_size: int, dp: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """ParamAndGradBuffer's layout: (bucket length, [(start, end) of each parameter in the bucket])."""
    return _bucket_layout(tuple(params), bucket_size, dp)


@functools.lru_cache(maxsize=1024)
def _bucket_layout(params: tuple[Param, ...], bucket_size: int, dp: int) -> list[tuple[int, list[tuple[int, int]]]]:
    out, offset, start, members = [], 0, 0, []
    for param in reversed(params):
        if param.alone and members:
            end = -(-offset // (ALIGN * dp)) * ALIGN * dp
            out.append((end - start, members))
            offset = start = end
            members = []
        lo = -(-offset // ALIGN) * ALIGN
        members.append((lo - start, lo - start + param.numel))
        offset = lo + param.numel
        if param.alone or offset - start >= bucket_size:
            end = -(-offset // (ALIGN * dp)) * ALIGN * dp
            out.append((end - start, members))
            offset = start = end
            members = []
    if members:
        end = -(-offset // (ALIGN * dp)) * ALIGN * dp
        out.append((end - start, members))
    return out


def model_state(cfg: Config, pp_rank: int = 0, dp_rank: int = 0) -> MemoryReport:
    """This rank's model state as the trainer lays it out (``dp_rank``: its rank among the dp x cp
    ranks, which shard zero 1-3's state; padding falls in the last shards)."""
    p, t = cfg.parallel, cfg.train
    dp = p.dp * p.cp
    chunks = rank_parameters(cfg, pp_rank)
    numel = sum(q.numel for chunk in chunks for q in chunk)
    if p.zero == 3:  # FSDP: dim-0 chunks of ceil(rows / dp) rows, fp32 shards and gradients
        local = 0
        for q in (q for chunk in chunks for q in chunk):
            size = -(-q.rows // dp)
            rows = max(0, min(q.rows, (dp_rank + 1) * size) - dp_rank * size)
            local += rows * (q.numel // q.rows)
        return MemoryReport(params=4 * local, grads=4 * local, main_params=0, optimizer_state=8 * local, numel=numel)
    pbytes, gbytes = DTYPE_BYTES[t.dtype], DTYPE_BYTES[t.grad_dtype]
    params = grads = main = state = 0
    spans: list[int] = []  # offload: the length of each staging span
    for chunk in chunks:
        for length, members in _buckets(chunk, p.bucket_size, dp):
            params += length * pbytes
            grads += length * gbytes if p.zero < 2 else 0
            lo, hi = (dp_rank * length // dp, (dp_rank + 1) * length // dp) if p.zero else (0, length)
            if p.zero == 2 or t.grad_dtype != "fp32":
                grads += 4 * (hi - lo)  # the optimizer's own fp32 gradient
            main += 4 * (hi - lo) if t.dtype != "fp32" or p.optimizer_offload else 0
            state += 8 * sum(max(0, min(b, hi) - max(a, lo)) for a, b in members)
            if p.optimizer_offload:
                inside = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in members if min(b, hi) > max(a, lo)]
                spans += [b - a for a, b in staging_spans(hi - lo, sorted(inside), p.offload_staging)]
    if p.optimizer_offload:  # (the gradients reach the host through the staging buffers)
        staging = 4 * max(spans, default=0) * staging_buffers(len(spans))
        return MemoryReport(params=params, grads=grads, main_params=0, optimizer_state=0, numel=numel,
                            host=main + state + staging)
    return MemoryReport(params=params, grads=grads, main_params=main, optimizer_state=state, numel=numel)


def optimizer_elements(cfg: Config, pp_rank: int = 0, dp_rank: int = 0) -> int:
    """The elements this rank's optimizer updates (zero 0-2: its ranges, padding included), which
    an offloaded step copies down and up."""
    p, dp = cfg.parallel, cfg.parallel.dp * cfg.parallel.cp
    lengths = [length for chunk in rank_parameters(cfg, pp_rank) for length, _ in _buckets(chunk, p.bucket_size, dp)]
    if p.zero in (1, 2):
        return sum((dp_rank + 1) * n // dp - dp_rank * n // dp for n in lengths)
    return sum(lengths)


# -- activations through the schedule ---------------------------------------------------------------
def activations_for(cfg: Config, plan: ExecutionPlan, device: str = "cuda") -> Activations:
    p, t = cfg.parallel, cfg.train
    return Activations(cfg.model, t.micro_batch, tp=p.tp, sequence_parallel=p.sequence_parallel, cp=p.cp,
                       dtype=t.dtype, fp8=t.fp8, fp8_gathered=plan.fp8_param_gather,
                       fused_elementwise=plan.fused_elementwise,
                       fused_cross_entropy=plan.fused_cross_entropy, device=device)


@dataclass(frozen=True)
class ChunkBytes:
    """One micro-batch through one chunk: what it holds from F to B (or I), what an I leaves until
    its W, and the largest transient of its forward and of its backward."""

    held: float
    deferred: float
    forward: float
    backward: float


def chunk_bytes(cfg: Config, act: Activations, stage: int, layers: range) -> ChunkBytes:
    t, last = cfg.train, cfg.parallel.pp * cfg.parallel.vpp - 1
    recomputed = 0 if t.recompute == "none" else min(t.recompute_layers or len(layers), len(layers))
    modes = [t.recompute] * recomputed + ["none"] * (len(layers) - recomputed)
    held = sum(act.layer_total(mode) for mode in modes)
    deferred = len(layers) * act.weight_grads_pending()
    backward = max((act.layer_transient(mode) for mode in set(modes)), default=0.0)
    forward = 0.0
    if stage == 0:
        held += act.embedding()
    if stage == last:
        held += act.head()
        deferred += act.head_weight_grads_pending()
        forward = act.logits_transient()
        backward = max(backward, forward)
    return ChunkBytes(held, deferred, forward, backward)


@dataclass(frozen=True)
class Prediction:
    """One rank's predicted peak and its parts (bytes)."""

    pp_rank: int
    state: MemoryReport
    activations: float  # held at the worst moment (in-flight micro-batch chunks, deferred W's)
    temporaries: float  # the transient at that moment
    in_flight: int  # the most micro-batch chunks held at once (F done, B or I not)

    @property
    def total(self) -> float:
        return self.state.total + self.activations + self.temporaries


FP8_LINEARS = (".qkv.weight", ".proj.weight", ".fc1.weight", ".fc2.weight")  # the layers' fp8 GEMMs' weights


def fp8_cache_bytes(chunk_params: list[list[Param]]) -> float:
    """The tensorwise fp8 weight cache (``Float8WeightCache``): each fp8 linear's weight at a byte."""
    return float(sum(q.numel for chunk in chunk_params for q in chunk if q.name.endswith(FP8_LINEARS)))


def _transients(cfg: Config, chunk_params: list[list[Param]], fp8_gather: bool = False) -> tuple[float, float]:
    """(during any compute, during a backward) from data parallelism: FSDP's gathered layers (the
    fp8 linears' weights at a byte where ``fp8_gather``), zero=2's gradient buckets in flight."""
    p, t = cfg.parallel, cfg.train
    if p.zero == 3:
        layers, gathered = Counter(), Counter()
        for q in (q for chunk in chunk_params for q in chunk if q.name.startswith("layers.")):
            in_fp8 = fp8_gather and q.name.endswith(FP8_LINEARS)
            layers[q.name.split(".")[1]] += q.numel
            gathered[q.name.split(".")[1]] += q.numel * (1 if in_fp8 else DTYPE_BYTES[t.dtype])
        return 2 * max(gathered.values(), default=0), 4 * max(layers.values(), default=0)
    if p.zero == 2:
        largest = max((length for chunk in chunk_params for length, _ in _buckets(chunk, p.bucket_size, p.dp * p.cp)),
                      default=0)
        return 0.0, 2 * largest * DTYPE_BYTES[t.grad_dtype]
    return 0.0, 0.0


def predict(cfg: Config, plan: ExecutionPlan, pp_rank: int = 0, dp_rank: int = 0, device: str = "cuda",
            microbatch_count: int | None = None) -> Prediction:
    """The peak of pipeline rank ``pp_rank`` (``cfg`` validated: ``parallel.dp`` set)."""
    p = cfg.parallel
    act = activations_for(cfg, plan, device)
    chunks = rank_chunks(cfg, pp_rank)
    per_chunk = [chunk_bytes(cfg, act, stage, layers) for stage, layers in chunks]
    params = rank_parameters(cfg, pp_rank)
    always, in_backward = _transients(cfg, params, plan.fp8_param_gather)
    if plan.fp8_weight_cache:
        always += fp8_cache_bytes(params)
    m = microbatch_count or microbatches(cfg)
    held = deferred = 0.0
    holding: set[tuple[int, int]] = set()
    best = (0.0, 0.0, 0.0)  # (total, activations, transient)
    in_flight = 0
    for action in _compute_order(plan.schedule, p.pp, p.vpp, m, pp_rank):
        c = per_chunk[action.chunk]
        key = (action.microbatch, action.chunk)
        if action.op == Op.F:
            holding.add(key)
            held += c.held
            in_flight = max(in_flight, len(holding))
            moment = (held + deferred, always + c.forward)
        elif action.op in (Op.B, Op.I):
            moment = (held + deferred, always + in_backward + c.backward)
            holding.discard(key)
            held -= c.held
            if action.op == Op.I:
                deferred += c.deferred
        else:  # W
            moment = (held + deferred, always)
            deferred -= c.deferred
        if sum(moment) > best[0]:
            best = (sum(moment), *moment)
    return Prediction(pp_rank, model_state(cfg, pp_rank, dp_rank), best[1], best[2], in_flight)


@functools.lru_cache(maxsize=4096)
def _compute_order(kind: str, pp: int, vpp: int, m: int, rank: int) -> tuple:
    return tuple(compute_order(kind, pp, vpp, m, rank))


def predict_ranks(cfg: Config, plan: ExecutionPlan, device: str = "cuda") -> list[Prediction]:
    """Every pipeline rank's peak (dp rank 0, which holds the most state where shards are uneven)."""
    return [predict(cfg, plan, r, 0, device) for r in range(cfg.parallel.pp)]


def gib(n: float) -> float:
    return n / 2**30


def describe(predictions: list[Prediction]) -> str:
    """One line for the run's start: the predicted peak per pipeline rank and its parts."""
    worst = max(predictions, key=lambda x: x.total)
    unit, size = ("GiB", 2**30) if worst.total >= 2**30 else ("MiB", 2**20)
    parts = (f"state {worst.state.total / size:.2f} + activations {worst.activations / size:.2f} "
             f"({worst.in_flight} micro-batch chunk{'s' if worst.in_flight != 1 else ''} in flight) + temporaries "
             f"{worst.temporaries / size:.2f}")
    per_rank = ", ".join(f"{x.total / size:.2f}" for x in predictions)
    where = f" on pipeline rank {worst.pp_rank}" if len(predictions) > 1 else ""
    return (f"predicted peak per rank ({unit}{', pipeline ranks in order' if len(predictions) > 1 else ''}): "
            f"[{per_rank}]; largest{where}: {parts} (memory model: docs/architecture.md, Memory)")


__all__ = ["Param", "Prediction", "chunk_parameters", "rank_parameters", "model_state", "optimizer_elements", "predict",
           "predict_ranks", "describe", "activations_for", "gib"]
