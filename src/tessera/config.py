"""Typed configuration: six sections, loaded from TOML, overridden with ``--set section.key=value``.

Every field has a default and a docstring (the string under it). Values are checked twice:
each section checks its own fields when it is built, and :func:`validate` checks what needs the
world size (tp * pp dividing it, batch divisibility, ...). Every failure is a :class:`ConfigError`
that names the key and says how to fix it, so the CLI can print one line instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tessera.pipeline_parallel.schedules import SPLIT_BACKWARD

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration the run cannot start with. ``key`` is the dotted name at fault.
    ``rank_local``: found by one rank only (e.g. in its share of the data), so that rank must say
    it; the others' errors are found on every rank and said once, by rank 0."""

    def __init__(self, key: str, problem: str, fix: str, rank_local: bool = False):
        self.key, self.problem, self.fix, self.rank_local = key, problem, fix, rank_local
        super().__init__(f"config error: {key}: {problem} -> {fix}")


def _check(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(key, problem, fix)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    family: Literal["gpt2", "llama"] = "gpt2"
    """gpt2: LayerNorm, GELU, learned positions, biases. llama: RMSNorm, SwiGLU, RoPE, GQA, no biases."""
    vocab_size: int = 256
    """Number of real token ids. The embedding is padded to a multiple of vocab_pad_multiple * tp;
    padded rows are never predicted."""
    vocab_pad_multiple: int = 64
    """The padded vocabulary is a multiple of this times tp (GPU GEMMs like multiples of 64)."""
    hidden: int = 128
    """Width of the residual stream."""
    layers: int = 4
    """Number of transformer layers."""
    heads: int = 4
    """Attention (query) heads."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means equal to heads (plain multi-head)."""
    ffn_hidden: int = 0
    """Width of the MLP; 0 means 4*hidden for gpt2 and 8/3*hidden rounded up to 64 for llama."""
    seq_len: int = 128
    """Tokens per sample."""
    tie_embeddings: bool = True
    """Share the input embedding matrix with the output projection."""
    dropout: float = 0.0
    """Dropout probability on attention weights and on each residual branch."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama only)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections of each residual
    branch are scaled by 1/sqrt(2*layers) as in GPT-2."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "vocab_pad_multiple", "hidden", "layers", "heads", "seq_len"):
            _check(getattr(self, name) > 0, f"model.{name}", "must be positive", "give a value >= 1")
        _check(self.kv_heads >= 0, "model.kv_heads", "must be >= 0", "use 0 for kv_heads = heads")
        _check(self.ffn_hidden >= 0, "model.ffn_hidden", "must be >= 0", "use 0 for the default width")
        _check(self.hidden % self.heads == 0, "model.hidden",
               f"{self.hidden} is not divisible by model.heads={self.heads}",
               "choose hidden as a multiple of heads")
        _check(self.heads % self.num_kv_heads == 0, "model.kv_heads",
               f"model.heads={self.heads} is not a multiple of kv_heads={self.num_kv_heads}",
               "choose kv_heads dividing heads")
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"{self.dropout} is not in [0, 1)",
               "give a probability such as 0.1 (0 disables dropout)")
        _check(self.family != "llama" or self.head_dim % 2 == 0, "model.hidden",
               f"hidden/heads = {self.hidden}/{self.heads} = {self.head_dim} is odd; RoPE rotates pairs of channels",
               "choose hidden and heads whose quotient (the head dimension) is even")
        _check(self.family == "llama" or self.num_kv_heads == self.heads, "model.kv_heads",
               "grouped-query attention is a llama feature", "set model.family='llama' or kv_heads=0")
        # (a negative epsilon or RoPE base gives NaN losses from the first step, silently; a
        # negative std fails deep inside the weights' initialisation)
        _check(self.norm_eps >= 1.2e-38, "model.norm_eps", f"{self.norm_eps} is not positive in fp32 "
               "(below 1.2e-38 it rounds to 0 or a subnormal there: 0/0 on an all-zero input)",
               "give a small positive epsilon such as 1e-5")
        _check(self.rope_theta > 0, "model.rope_theta", f"{self.rope_theta} is not positive",
               "give a positive base frequency such as 10000")
        _check(self.init_std >= 0, "model.init_std", f"{self.init_std} is negative",
               "give a standard deviation such as 0.02")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.family == "gpt2":
            return 4 * self.hidden
        return -(-(8 * self.hidden // 3) // 64) * 64


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: each layer's matrices are split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are cut into this many stages."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per rank, for the interleaved schedule."""
    dp: int = 0
    """Data-parallel size; 0 derives it as world_size / (tp * pp)."""
    sequence_parallel: bool = False
    """Split activations along the sequence inside TP regions (norms, dropout) and replace
    all-reduces by all-gather / reduce-scatter pairs."""
    pp_layout: str = "auto"
    """Layers of each virtual pipeline stage, comma-separated (pp*vpp entries, e.g. "3,4,4,3");
    "even" splits the layers evenly; "balanced" splits them by time, the last stage's output
    head counted as the layers it takes (0.6 of its FLOPs: its one large GEMM runs faster than a
    layer's kernels; GPT-1.3B at pp=2: 13,11; at pp=2 vpp=2: 7,6,6,5; Llama-1B at pp=2 vpp=2:
    5,5,4,2; it moves layers, and so activation memory, onto the first stages); auto: balanced
    when vpp > 1 (at pp=2 vpp=2 on 2x H200: GPT-1.3B 4.8 % faster than even; Llama-1B 0.827-0.833
    of one GPU with two 9/7-per-rank layouts, 0.766 even, 0.811 with the FLOPs split's 10/6, from
    three calls; 5,5,4,2 itself not yet run), else even."""
    schedule: Literal["auto", "none", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "interleaved-zb"] = "auto"
    """Pipeline schedule. auto: the fastest valid one by the schedule simulator (no pipelining at
    pp=1, interleaved-zb when vpp > 1 (interleaved with zero >= 2), else zero-bubble ZB-H1; never
    ZB-H1 or interleaved-zb with zero >= 2; never
    zb-h2, which costs memory). zb-h2: ZB-H1 with ZB-H2's memory: more warm-up forwards and longer
    W deferral fill the start of the step where the backward's input-gradient half costs more than
    a forward; every rank holds up to 2pp-1 micro-batches from F to W instead of pp (rank 0 as
    activations, the last rank as deferred weight gradients' inputs; pipeline_parallel/schedules.py).
    interleaved-zb (vpp >= 2): the interleaved order with the backward split into I and W, rank r
    running each W 2r I's late; no rank holds more than interleaved's rank 0. GPT-1.3B at pp=2,
    vpp=2: 6 % faster than interleaved and 1-2 % faster than ZB-H1 (vpp=1), for 1.5 GiB more
    memory (BENCHMARKS.md, session 9)."""
    zero: Literal[0, 1, 2, 3] = 0
    """Data-parallel sharding. 0: optimizer replicated, gradients all-reduced. 1: distributed
    optimizer: fp32 main parameters and Adam states sharded over dp, gradients reduce-scattered,
    updated parameters all-gathered. 2: gradients sharded too (reduce-scattered after every
    micro-batch, no full-size gradient buffer kept). 3: FSDP (torch fully_shard) on the dp mesh:
    parameters sharded as well."""
    bucket_size: int = 40_000_000
    """Elements per gradient bucket (zero 0-2): each bucket's reduction starts as soon as its
    gradients are final."""
    overlap_grad_reduce: bool = True
    """Start each bucket's gradient reduction during the last micro-batch's backward, overlapped
    with the rest of it (zero 0-2). Off: reduce everything after backward."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """zero 0-2: the dtype gradients travel in over dp. bf16 halves the traffic of fp32 gradient
    buffers (each rank's accumulated gradient rounded once); the sums are still done in fp32.
    Never wider than the buffers: bf16 ones (train.grad_dtype=bf16) travel as bf16 either way."""
    tp_comm_overlap: Literal["auto", "true", "false"] = "auto"
    """tp > 1: a column-parallel layer's backward starts its input gradient's all-reduce (or, with
    sequence parallelism, reduce-scatter) as soon as that gradient is computed and runs the
    weight-gradient GEMM while it travels. auto: on with CUDA-graphed layers (train.cuda_graphs,
    the CUDA default at tp > 1): on GPT-1.3B at tp=2 + SP +1.6 % and +1.9 % in two alternated
    A/Bs (session 14), +2.6 % (session 7); off around eager layers (-1.8 % in one A/B, session 3)
    and compiled ones (its asynchronous collectives break dynamo's graph, ~6 breaks per layer).
    false: the collective, then the GEMM (BENCHMARKS.md)."""
    tp_microbatch_pairs: Literal["auto", "true", "false"] = "auto"
    """tp > 1, pp=1: run the step's micro-batches two at a time, the second of each pair on a side
    CUDA stream with a TP communicator of its own, so one micro-batch's TP collectives run
    while the other's GEMMs do (training/concurrent.py; an odd last micro-batch runs alone; the
    same sums as without, but on a GPU a pair's two fp32 adds into a gradient come in either
    order, which can change from run to run at rounding level, and with dropout the masks are
    drawn in another order than without pairs). +13.7 % on GPT-1.3B (2x H200) and +8.3 % on
    Llama-1B (2x H100) at tp=2 + SP with graphed layers (session 18), BUT experimental: the two
    communicators' collectives are in flight at once, which NCCL documents may deadlock, and
    4 of 19 GPT-1.3B tp=2 + SP runs of benchmarks/pairs_ab.py hung within their first 10 steps
    (session 19; both ranks' hosts blocked in a layer's graph replay). So auto is OFF until that
    is fixed; true opts in. Costs a second micro-batch's activations (+2.2 GiB on GPT-1.3B), a
    second set of graphs and a second TP communicator. Not with compiled layers, fused weight
    gradients, zero=3 or parallel.tp_async (true is refused there)."""
    tp_pairs_backward: Literal["threads", "in_turn"] = "threads"
    """With parallel.tp_microbatch_pairs=true, how a pair's two backwards are issued. threads:
    the second from a worker thread while this one runs the first (measured in session 18; the
    order autograd then issues the two communicators' collectives in may differ between ranks,
    the suspected cause of the hangs). in_turn: this thread issues both, a piece at a time (the
    losses, then each layer from the last), the two micro-batches in turn, so every rank issues
    the collectives in one order (experimental, CPU-tested to the bit against no pairs; not
    measured on a GPU yet). Not with zero=2, which runs the two backwards one after the other."""
    tp_async: Literal["false", "true", "p2p"] = "false"
    """tp > 1 with sequence parallelism: each column layer's all-gather and row layer's
    reduce-scatter run fused with the GEMM, chunked and overlapped, both directions
    (tensor_parallel/async_tp.py). true: torch's symmetric-memory fused_all_gather_matmul /
    fused_matmul_reduce_scatter on CUDA, measured slower on 2x H100 at tp=2 (18,235 against
    30,656 tokens/s eager, BENCHMARKS.md session 4). p2p: a ring of NCCL sends and receives, one
    sequence chunk on the wire while another multiplies: with eager layers measured slower at
    tp=2 (13,522 against 18,172 plain, session 5). Inside CUDA-graphed layers
    (train.cuda_graphs=true) both follow one GPU (GPU test); true measured 41,315 against the
    plain graphed 40,991 tokens/s (+0.8 %, one call, session 8), p2p 38,843 against 40,773
    (session 7). Off by default."""
    overlap_param_gather: bool = True
    """zero 1-2: all-gather the updated parameters asynchronously after the optimizer step, each
    bucket waited for only by the first forward that uses it. (Stepping the optimizer bucket by
    bucket with each gather started after its update, Megatron's
    overlap_param_gather_with_optimizer_step, was measured 4.8 % slower at dp=2 on 2x H100,
    BENCHMARKS.md session 10, and removed.)"""

    def __post_init__(self) -> None:
        _check(self.zero in (0, 1, 2, 3), "parallel.zero", f"{self.zero!r} is not 0, 1, 2 or 3",
               "use 0 (replicated), 1 (distributed optimizer), 2 (+ sharded gradients) or 3 (FSDP)")
        _check(self.bucket_size >= 1, "parallel.bucket_size", "must be >= 1", "give elements per bucket, e.g. 40000000")
        for name in ("tp", "pp", "vpp"):
            _check(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1", "use 1 for no parallelism on this axis")
        _check(self.dp >= 0, "parallel.dp", "must be >= 0", "use 0 to derive it from the world size")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    micro_batch: int = 4
    """Samples per micro-batch on one data-parallel rank."""
    global_batch: int = 16
    """Samples per optimizer step over all data-parallel ranks (accumulated over micro-batches)."""
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed for weights, data order and dropout; the same seed gives the same model on any layout."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Precision of the model's parameters and compute. bf16/fp16: the model holds 16-bit
    parameters and the optimizer fp32 main parameters (fp16 with dynamic loss scaling); under
    zero=3, FSDP keeps fp32 shards and casts to this dtype for compute."""
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision in which gradients accumulate over micro-batches and are reduced over dp. bf16
    halves the gradient buffer; its reduce-scatter then accumulates in fp32."""
    out_dir: str = "runs/default"
    """Directory for metrics.jsonl and other run outputs."""
    log_every: int = 10
    """Print one console line every this many steps."""
    tensorboard: bool = False
    """Also write every step's numeric metrics as TensorBoard scalars (train/loss, train/lr, ...;
    valid/loss, valid/ppl) to out_dir/tensorboard/run-N, a folder per run (N: the number this
    run's metrics.jsonl and config.toml are kept aside under once a later run starts), each
    run its own curve; view with `tensorboard --logdir <out_dir>/tensorboard`. Booleans
    (skipped) are written as 0/1; non-finite values (a NaN loss) are left out (null in
    metrics.jsonl). Needs the tensorboard package (`pip install tensorboard`)."""
    eval_every: int = 0
    """Every this many steps, and after the last, the validation loss: the mean loss per token
    over the first train.eval_batches global batches of the data's validation split (data.split's
    second part; synthetic data: a stream of its own). 0: never."""
    eval_batches: int = 10
    """Global batches of train.global_batch samples each validation loss is taken over."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available (NCCL), else cpu (gloo)."""
    sample_tokens: int = 0
    """After training, generate this many tokens from sample_prompt and print them (0: none)."""
    sample_prompt: str = "The "
    """Prompt for the sample printed after training."""
    sample_tokenizer: str = ""
    """The sample's tokenizer: a tokenizer.json (or a folder holding one); empty: the data's own
    (bytes for data.source=builtin, PREFIX.tokenizer.json beside the first indexed dataset)."""
    compile: Literal["auto", "true", "false"] = "auto"
    """torch.compile each transformer layer (inductor fuses its elementwise work; the first steps
    pay the compile time). Linear layers whose weight gradients are deferred (zb-h1, zb-h2,
    interleaved-zb) or fused (train.grad_accum_fusion) used to run eagerly between compiled
    pieces, a graph break each, which cost more CPU time per step than the compiled pieces
    saved (measured, BENCHMARKS.md); since session 14 they are opaque ops inside the layer's one
    graph (tensor_parallel/wgrad.py; the TP-overlap and async-TP linear layers still break it).
    auto: on for CUDA runs of the llama family at tp=1 whose schedule does not split the backward
    (+10% on Llama-1B; with fused weight gradients inside, +5% more, session 16); off elsewhere (on GPT-1.3B at tp=1
    fused weight gradients in eager layers measured 2% faster). Off at tp > 1: compiled layers
    follow one GPU there (the TP collectives run as opaque ops in compiled code; the GPU test
    passes since session 6) but measured slower than eager layers at tp=2 (19,184 against 21,686
    tokens/s, same call), and CUDA-graphed eager layers are faster still (train.cuda_graphs)."""
    grad_accum_fusion: Literal["auto", "true", "false"] = "auto"
    """Gradient-accumulation fusion: a linear layer's weight-gradient GEMM adds straight into the
    fp32 main gradient (one cuBLAS call with an fp32 accumulator on CUDA; for 16-bit inputs off
    CUDA, the reference matmul-then-add), so no 16-bit weight gradient is stored and added. With
    parallel.zero 0-2. auto: on for CUDA runs at tp=1 with zero 0-2, in eager layers or in
    layers auto compiled (measured +2% on GPT-1.3B against compiled layers; in Llama-1B's
    compiled layers 62,988 against 59,998 tokens/s, H100, BENCHMARKS.md session 16); off at tp > 1
    (in eager layers measured 15% slower at tp=2, where the smaller GEMMs leave the step bound by
    the CPU time per layer that the fused path adds to) and on CPU. true at tp > 1 with CUDA-graphed
    layers (train.cuda_graphs) captures the fused GEMMs in the graphs (zero 0/1; opt-in: +0.4 %
    at tp=2, BENCHMARKS.md session 11)."""
    cuda_graphs: Literal["auto", "true", "false"] = "auto"
    """Capture each transformer layer's forward and backward as CUDA graphs and replay them
    (training/cuda_graphs.py): two graph launches per layer and micro-batch instead of dozens of
    kernels, for layouts bound by the host's launch time. Capturable: CUDA, pp=1, no dropout, no
    packed sequences, eager layers (with fused weight gradients only at zero 0/1), not zero=3
    (true refuses the rest with the reason). Zero 1/2's overlapped parameter gather is taken:
    its waits are lifted for the capture and run before each replay (GPU test, session 12).
    auto: on for capturable CUDA runs at tp > 1 (GPT-1.3B at tp=2 + SP: 40,370 against 24,223
    tokens/s eager on 2x H100, same call, BENCHMARKS.md session 6), also with the opt-in
    overlapped TP paths (parallel.tp_async, tp_comm_overlap=true, with or without SP), which graphed
    follow one GPU (GPU test) and run within 3 % of the plain graphed layers but eager far
    slower (tp_async=true: 12,206 eager against 41,315 graphed, session 8), and with zero 1/2's
    overlapped gather at dp > 1; off at tp=1, where fused weight gradients are faster."""
    fused_elementwise: Literal["auto", "true", "false"] = "auto"
    """The llama family's RMSNorm, RoPE and SwiGLU as compiled functions (one generated kernel each
    way, models/fused.py) inside eager layers on CUDA: the elementwise fusions of compiled layers
    where whole layers are not compiled (split-backward pipeline schedules, CUDA-graphed layers
    at tp > 1, fused weight gradients). On a CPU, or inside compiled layers: the reference ops.
    The llama family only (true refuses gpt2). auto: on for llama wherever its layers are not
    compiled whole on CUDA (Llama-1B, 2x H200, BENCHMARKS.md session 15: pp=2 vpp=2 57,835
    against 51,924 tokens/s per GPU, 0.92 of one GPU; tp=2 + SP in graphed layers 49,266
    against 45,279)."""
    fused_cross_entropy: bool = True
    """The fused vocab-parallel cross entropy on CUDA (compiled kernels on the 16-bit logits; no
    fp32 copy of the [tokens, vocab] logits is stored). Off, or on a CPU: the reference ops."""
    gc_interval: int = 0
    """Python's garbage collection: 0 leaves it automatic (each rank's host collects whenever it
    allocated enough, at a different moment on each rank). N > 0: automatic collection off while
    training, a full collection every N steps on every rank at once, and before and after the
    loop (training/gc_control.py; Megatron's --manual-gc,
    torchtitan's gc_freq); what is alive when training starts is frozen out of the collections'
    sight. Opt-in: measured at GPT-1.3B dp=2 on 2x H100 (session 16) before that freeze, each
    full collection held the host ~225 ms (every 10th step 520-538 ms against ~298), which cost
    more than the automatic collector's rare slow steps (the slowest of 40: 348 ms); with the
    freeze, each collection still cost ~0.3 s of step time (GPT-1.3B dp=2, gc_interval=5, 2x
    H200, session 17), though a frozen collection takes ~0.1 ms on a CPU; the metrics log each
    collection's host time as gc_ms, ~250 ms each on the GPU machine (session 18): the first
    periodic collection now also freezes what the first steps made, which did not help (~270 ms
    still, session 19)."""
    timeout_s: float = 300.0
    """Collective timeout: a dead or stuck peer ends the job with an error after this long. Also
    the step watchdog's (training/watchdog.py): a training step after the first that takes
    longer than this and five times the slowest step before it dumps every thread's stack to
    stderr and ends the job (a hang NCCL's watchdog does not see: collectives captured in CUDA
    graphs, a host blocked in a graph replay)."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation (Megatron's --recompute-granularity full): a recomputed layer keeps
    only its input through the forward and runs again in the backward (torch.utils.checkpoint),
    its dropout masks drawn again from the same random streams (tensor_parallel/random.py), so
    gradients equal a run without it. Saves a layer's activations for a second forward. GPT-1.3B
    on one H200 (BENCHMARKS.md session 27): micro-batch 2 59,651 -> 32,769 tokens/s, peak memory
    28.9 -> 23.3 GiB (a small micro-batch turns host-bound: the checkpoint's Python per layer);
    micro-batch 8 with it 49,286 tokens/s in 26.8 GiB. For what does not fit otherwise. Eager
    layers (compiled and CUDA-graphed layers are not recomputed: train.compile and
    train.cuda_graphs auto turn off, true is refused). none: every activation is kept."""
    recompute_layers: int = 0
    """train.recompute=full: how many layers of each pipeline chunk, from its first, are recomputed
    (Megatron's block method: fewer layers, less compute, more memory); 0, or more than a chunk
    holds: all of them."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """What a bf16/fp32 step whose gradient norm is inf or nan does (training/rerun.py). Either
    way the step changes nothing (weights, Adam's moments and step count stay as they were: the
    fused AdamW kernel skips it on the GPU, with no host wait), so no later checkpoint holds a
    nan. stop: every step after it is skipped too; the run then re-runs that step's batch on the
    same weights and random streams, says whether the non-finite value came back (reproducible:
    the batch, the model or the settings, e.g. the learning rate) or not (transient: suspect the
    machine, e.g. a GPU's memory) and which samples the batch held, and stops (exit status 3, also
    from tessera train --nproc-per-node; a torchrun started by hand says 1); checkpoints saved before it are kept. skip: the run goes
    on without that step (its batch is passed over). Either way the run stops after
    train.max_skipped_steps skipped steps in a row, and the learning-rate schedule counts a
    skipped step as it counts fp16's (by the loop's step). A non-finite gradient anywhere counts,
    also one the norm leaves out (a copy of a replicated gradient, a dp replica's at zero=0: one
    more number in the norm's and the loss's all-reduces). fp16 runs: a step skipped by dynamic
    loss scaling is not counted (the scale halves and the run goes on)."""
    skip_spikes: float = 0.0
    """Pass over a step whose gradient norm lies more than this many standard deviations above
    the mean of the last train.spike_window applied steps' norms, as a non-finite one under
    train.nonfinite=skip (nothing changes; the batch is passed over), once that window is full;
    decided on the GPU, no host wait (OLMo 2's loss-spike remedy, there with 6 sigma over 128
    steps). The norm is the global one every rank holds (the loss is known on the last pipeline
    stage only). 0: off."""
    spike_window: int = 128
    """Applied steps whose gradient norms train.skip_spikes compares a step with."""
    max_skipped_steps: int = 10
    """The run stops after this many skipped steps in a row (non-finite or spikes)."""
    inject_fault_step: int = 0
    """To try the guards (as Megatron's error injection): at this step (counting from 1; 0: never)
    rank 0 corrupts one of its gradients as train.inject_fault says."""
    inject_fault: Literal["nan", "nan_once", "spike"] = "nan"
    """nan: a nan every time the step runs (a reproducible fault); nan_once: only the first time
    (transient: the re-run is clean); spike: the gradient times 1e4 (a finite spike). bf16 and
    fp32 runs (fp16's loss scaling takes a nan for an overflow)."""
    batch_rampup: str = ""
    """Global-batch ramp-up as "start,increment,ramp_samples": begin at start samples per step and
    add increment, in equal slices of ramp_samples consumed samples, until global_batch. Empty:
    a constant global_batch."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "global_batch", "steps", "log_every", "eval_batches"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1", "give a value >= 1")
        _check(self.eval_every >= 0, "train.eval_every", f"{self.eval_every} is below 0",
               "give steps between validation losses, or 0 for none")
        _check(self.sample_tokens >= 0, "train.sample_tokens", "must be >= 0", "use 0 for no sample")
        _check(1 <= self.timeout_s <= 1e9, "train.timeout_s", f"{self.timeout_s} is not in [1, 1e9] seconds "
               "(the process group's setup waits for every rank that long)", "give seconds, e.g. 300")
        _check(0 <= self.seed < 2**62, "train.seed", f"{self.seed} is outside [0, 2**62)",
               "give a non-negative seed (numpy's data order takes no negative one; torch's, none of 2**64 or more)")
        _check(self.recompute_layers >= 0, "train.recompute_layers", f"{self.recompute_layers} is below 0",
               "give the layers per pipeline chunk to recompute, or 0 for all")
        _check(self.recompute != "none" or not self.recompute_layers, "train.recompute_layers",
               "is set but train.recompute=none", "set train.recompute=full")
        _check(self.recompute == "none" or self.compile != "true", "train.compile",
               "true with train.recompute: compiled layers are not recomputed", "set train.compile=auto or false")
        _check(self.max_skipped_steps >= 1, "train.max_skipped_steps", f"{self.max_skipped_steps} is below 1",
               "give the skipped steps in a row to stop after, e.g. 10")
        _check(self.inject_fault_step >= 0, "train.inject_fault_step", f"{self.inject_fault_step} is below 0",
               "give the step (from 1) to inject a fault at, or 0 for never")
        _check(math.isfinite(self.skip_spikes) and self.skip_spikes >= 0, "train.skip_spikes",
               f"{self.skip_spikes} is not a number of standard deviations >= 0", "give e.g. 6, or 0 for off")
        _check(self.spike_window >= 2, "train.spike_window", f"{self.spike_window} steps give no standard deviation",
               "give the applied steps to compare with, >= 2 (e.g. 128)")
        _check(self.gc_interval >= 0, "train.gc_interval", f"{self.gc_interval} is below 0",
               "give steps between collections, e.g. 50, or 0 for Python's automatic collection")
        rampup = self.rampup
        if rampup is not None:
            start, increment, ramp_samples = rampup
            _check(start <= self.global_batch, "train.batch_rampup",
                   f"start {start} exceeds train.global_batch={self.global_batch}",
                   "choose a start batch <= global_batch")
            _check(ramp_samples >= 1 or start == self.global_batch, "train.batch_rampup",
                   f"a ramp from {start} to global_batch={self.global_batch} over 0 samples",
                   "give the samples the ramp lasts (>= 1), or leave train.batch_rampup empty for a constant batch")
            _check((self.global_batch - start) % increment == 0, "train.batch_rampup",
                   f"increment {increment} does not divide global_batch - start = {self.global_batch - start}",
                   "choose an increment that divides the difference")

    @property
    def rampup(self) -> tuple[int, int, int] | None:
        """``batch_rampup`` parsed as (start, increment, ramp_samples); None for a constant batch."""
        if not self.batch_rampup.strip():
            return None
        fix = 'write three integers "start,increment,ramp_samples", e.g. "4,4,1000"'
        try:
            start, increment, ramp_samples = (int(x) for x in self.batch_rampup.split(","))
        except ValueError:
            raise ConfigError("train.batch_rampup", f"'{self.batch_rampup}' is not three integers", fix) from None
        _check(start >= 1 and increment >= 1 and ramp_samples >= 0, "train.batch_rampup",
               f"'{self.batch_rampup}' needs start >= 1, increment >= 1 and ramp_samples >= 0", fix)
        return start, increment, ramp_samples


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    warmup: int = 10
    """Linear warmup steps from 0 to lr."""
    decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "wsd"] = "cosine"
    """Shape of the rate after warmup. constant: lr. linear / cosine: lr to min_lr over the decay.
    inverse-square-root: lr*sqrt(warmup)/sqrt(step), at least min_lr (ignores decay_steps).
    wsd: stable at lr, then linear to min_lr over the last wsd_decay_steps."""
    decay_steps: int = 0
    """Steps of warmup + decay; 0 means train.steps. The rate stays at min_lr after."""
    wsd_decay_steps: int = 0
    """Length of the final linear decay of the wsd style; 0 means 10% of the steps after warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to norms, biases); the value used
    throughout when weight_decay_incr_style is constant."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from start_weight_decay to end_weight_decay over the decay steps;
    constant keeps optim.weight_decay."""
    start_weight_decay: float = 0.0
    """Weight decay at step 0 when weight_decay_incr_style is not constant."""
    end_weight_decay: float = 0.1
    """Weight decay at the end of the decay steps when weight_decay_incr_style is not constant."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", "must be positive", "give a rate such as 3e-4")
        _check(0 <= self.min_lr <= self.lr, "optim.min_lr", f"{self.min_lr} is not in [0, optim.lr]",
               f"choose min_lr <= lr = {self.lr}")
        _check(self.warmup >= 0, "optim.warmup", "must be >= 0", "use 0 for no warmup")
        _check(self.decay_steps >= 0, "optim.decay_steps", "must be >= 0", "use 0 to decay over train.steps")
        _check(self.wsd_decay_steps >= 0, "optim.wsd_decay_steps", "must be >= 0",
               "use 0 for 10% of the decay steps")
        for name in ("weight_decay", "start_weight_decay", "end_weight_decay"):
            _check(getattr(self, name) >= 0, f"optim.{name}", "must be >= 0", "use 0 for no weight decay")
        _check(self.clip_grad >= 0, "optim.clip_grad", "must be >= 0", "use 0 to disable clipping")
        _check(0 <= self.beta1 < 1, "optim.beta1", "must be in [0, 1)", "the usual value is 0.9")
        _check(0 <= self.beta2 < 1, "optim.beta2", "must be in [0, 1)", "the usual value is 0.95")
        _check(self.eps > 0, "optim.eps", f"{self.eps} is not > 0 (Adam divides by sqrt(v) + eps, and v is 0 "
               "where a gradient has always been 0)", "the usual value is 1e-8")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["builtin", "synthetic", "indexed"] = "builtin"
    """builtin: the demo corpus shipped with Python (pydoc topics), byte tokens. synthetic: seeded
    random tokens. indexed: Megatron .bin/.idx datasets named by data.paths."""
    paths: list[str] = field(default_factory=list)
    """indexed: dataset prefixes (PREFIX.bin / PREFIX.idx), optionally weighted as Megatron's
    ["0.7", "prefixA", "0.3", "prefixB"]; without weights, each in proportion to its tokens (of
    the split drawn from); on the command line, comma-separated."""
    split: str = "969,30,1"
    """Train / valid / test weights; each dataset's documents are split in contiguous ranges."""
    cache_dir: str = ""
    """Where the sample indices (.npy) are cached; empty: an index-cache folder beside each dataset."""
    eod_id: int = -1
    """The end-of-document token id (needed by the three options below); -1: none."""
    reset_position_ids: bool = False
    """Packed sequences: positions restart at 0 after every end-of-document token."""
    reset_attention_mask: bool = False
    """Packed sequences: tokens attend only within their own document (variable-length attention)."""
    eod_mask_loss: bool = False
    """No loss on the prediction made at an end-of-document token (its target is the next
    document's first token), as Megatron's --eod-mask-loss."""

    def __post_init__(self) -> None:
        _check(self.source != "indexed" or bool(self.paths), "data.paths", "data.source=indexed needs datasets",
               "give data.paths, e.g. --set data.paths=my-corpus_text_document "
               '(in a TOML file: paths = ["my-corpus_text_document"])')
        packing = self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        _check(not packing or self.eod_id >= 0, "data.eod_id",
               "reset_position_ids / reset_attention_mask / eod_mask_loss need the end-of-document id",
               "set data.eod_id (the id your preprocessing appended: `tessera preprocess` and "
               "`tessera data inspect PREFIX` print it)")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str = ""
    """Folder of this run's checkpoints, each ``step_N`` (complete, or not there at all); a run
    resumes from its newest by itself. Empty: nothing saved."""
    save_every: int = 0
    """Save every this many steps (0: only at the end); the last step is always saved."""
    load: str = ""
    """Start from this checkpoint instead: a ``step_N`` folder, or a folder of them (its
    newest); on any layout (tp, pp, vpp, dp, zero) and dtype. Empty: checkpoint.dir's newest,
    if any."""
    finetune: bool = False
    """From checkpoint.load take the model's weights only: Adam starts afresh, at step 0, at the
    data's start, with this run's schedule and batch sizes (a run resuming from checkpoint.dir's
    own checkpoints takes everything, as always)."""
    new_schedule: bool = False
    """Resume everything (weights, Adam's moments and step, the data's position, the random
    streams) but take the learning-rate and weight-decay schedule from this run's optim settings
    and train.steps, where a resume otherwise refuses a change (Megatron's
    --override-opt_param-scheduler): e.g. a lower optim.lr after a loss spike, or a longer run
    with a new decay. The new schedule takes over at the resumed step. Batch sizes must still
    match."""
    keep: int = 0
    """Keep only the newest this many checkpoints in checkpoint.dir (0: keep all)."""
    async_save: bool = False
    """Copy each checkpoint to host memory and write it while training goes on (a thread and a
    gloo group of its own); the run waits only for the copy. Needs host memory for a copy of
    each rank's part (~12 bytes per parameter it writes)."""

    def __post_init__(self) -> None:
        for key in ("save_every", "keep"):
            _check(getattr(self, key) >= 0, f"checkpoint.{key}", f"{getattr(self, key)} is negative",
                   "give 0 or a positive count")
        for key in ("save_every", "keep"):
            _check(self.dir or not getattr(self, key), f"checkpoint.{key}", "is set but checkpoint.dir is not",
                   "set checkpoint.dir, the folder checkpoints are saved in")
        _check(self.load or not self.finetune, "checkpoint.finetune", "is set but checkpoint.load is not",
               "set checkpoint.load, the checkpoint whose weights the run starts from")
        _check(not (self.finetune and self.new_schedule), "checkpoint.new_schedule",
               "is set with checkpoint.finetune, which takes this run's schedule anyway",
               "set only one: finetune (weights only) or new_schedule (everything but the schedule)")


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(key: str, keys_under: list[str] = ()) -> ConfigError:
    """An unknown ``section.key``, or section (with the ``keys_under`` it was given): the closest
    known name, where one is close."""
    if "." in key:
        close = difflib.get_close_matches(key, _all_keys(), n=1)
    else:
        section = difflib.get_close_matches(key, list(SECTIONS), n=1)
        close = [f"{section[0]}.{k}" for k in keys_under if f"{section[0]}.{k}" in _all_keys()][:1] or section \
            if section else []
    fix = f"did you mean '{close[0]}'?" if close else "`tessera config` lists every key"
    return ConfigError(key, "unknown section" if "." not in key else "unknown key", fix)


def a_or_an(noun: str) -> str:
    """"a str", "an int": for messages that name a type."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check (and for strings from the command line, parse) ``value`` against the field's type."""
    if typing.get_origin(hint) is list:  # list[str]: a TOML list, or "a,b,c" from --set
        items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ConfigError(key, f"{value!r} is not a list of strings",
                              'give a list, e.g. ["0.5", "a", "0.5", "b"] in a TOML file, 0.5,a,0.5,b with --set')
        return items
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
    base = type(choices[0]) if choices else hint
    if choices and "true" in choices and (isinstance(value, bool) or isinstance(value, str)):
        # an auto/true/false choice takes what a bool field takes: TOML booleans, True, 1, yes
        lowered = str(value).strip().lower()
        value = {"1": "true", "yes": "true", "0": "false", "no": "false"}.get(lowered, lowered)
    if isinstance(value, str) and base is not str:
        text = value.strip()
        try:
            if base is bool:
                lowered = text.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                value = lowered in ("true", "1", "yes")
            elif base is int:
                value = int(text)
            elif base is float:
                value = float(text)
        except ValueError:
            raise ConfigError(key, f"'{value}' is not {a_or_an(base.__name__)}",
                              f"give {a_or_an(base.__name__)} value") from None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(key, f"{value!r} has type {type(value).__name__}, expected {base.__name__}",
                          f"choose one of {', '.join(map(str, choices))}" if choices else f"give {a_or_an(base.__name__)} value")
    if base is float and not math.isfinite(value):  # no setting means anything at inf or nan
        raise ConfigError(key, f"{value} is not a finite number", "give a finite value")
    if choices and value not in choices:
        names = ", ".join(map(str, choices))
        raise ConfigError(key, f"'{value}' is not one of {names}", f"choose one of {names}")
    return value


def build_config(values: dict[str, dict[str, Any]]) -> Config:
    """Build a checked :class:`Config` from ``{section: {key: value}}`` (strings are parsed)."""
    sections = {}
    for name, table in values.items():
        if name not in SECTIONS:
            raise _unknown(name, list(table) if isinstance(table, dict) else [])
        if not isinstance(table, dict):
            raise ConfigError(name, "is not a table", f"write it as [{name}] with keys under it")
    for name, cls in SECTIONS.items():
        table = values.get(name, {})
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in table.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                raise _unknown(dotted)
            kwargs[key] = _coerce(dotted, value, hints[key])
        sections[name] = cls(**kwargs)
    return Config(**sections)


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """``["model.hidden=256", ...]`` -> ``{"model": {"hidden": "256"}}`` (values parsed later)."""
    out: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(item, "an override must look like section.key=value",
                              "for example --set parallel.tp=2")
        out.setdefault(section, {})[name] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (optional), apply ``section.key=value`` overrides, and check the result."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("--config", f"file '{path}' does not exist", "give the path of a TOML file") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError("--config", f"cannot read '{path}' ({e.strerror})", "give the path of a TOML file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"'{path}' is not valid TOML ({e})", "fix the file's syntax") from None
    for section, table in parse_overrides(list(overrides)).items():
        values.setdefault(section, {})
        if not isinstance(values[section], dict):
            raise ConfigError(section, "is not a table", f"write it as [{section}] with keys under it")
        values[section].update(table)
    return build_config(values)


def validate(cfg: Config, world_size: int) -> Config:
    """Checks that need the world size. Returns ``cfg`` with ``parallel.dp`` resolved."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    mp = p.tp * p.pp
    _check(world_size % mp == 0, "parallel.tp",
           f"tp*pp = {p.tp}*{p.pp} = {mp} does not divide the world size {world_size}",
           f"choose tp and pp whose product divides {world_size}, or launch a multiple of {mp} processes")
    dp = p.dp or world_size // mp
    _check(dp * mp == world_size, "parallel.dp",
           f"tp*pp*dp = {mp}*{p.dp} = {mp * p.dp} is not the world size {world_size}",
           "set parallel.dp=0 to derive it")
    if p.zero == 3 and world_size == 1:
        # FSDP shards over a process group (the topology's dp mesh), and a single launched
        # process runs without one (training/launch.py); one set up by the caller will do
        import torch.distributed as dist  # late: torch
        _check(dist.is_available() and dist.is_initialized(), "parallel.zero",
               "zero=3 (FSDP) needs a process group, and a single process runs without one",
               "use parallel.zero=0 (one process has nothing to shard over), or launch several processes")
    # builtin and synthetic data read no datasets: paths given with them would be ignored silently
    _check(cfg.data.source == "indexed" or not cfg.data.paths, "data.paths",
           f"data.source={cfg.data.source} reads no datasets, so {cfg.data.paths} would be ignored",
           "set data.source=indexed to train on them, or leave data.paths empty")
    _check(m.heads % p.tp == 0, "model.heads", f"{m.heads} heads are not divisible by tp={p.tp}",
           "choose heads as a multiple of parallel.tp")
    _check(m.num_kv_heads % p.tp == 0, "model.kv_heads",
           f"{m.num_kv_heads} kv heads are not divisible by tp={p.tp}",
           "choose kv_heads as a multiple of parallel.tp")
    _check(m.ffn_size % p.tp == 0, "model.ffn_hidden", f"{m.ffn_size} is not divisible by tp={p.tp}",
           "choose ffn_hidden as a multiple of parallel.tp")
    _check(t.global_batch % (t.micro_batch * dp) == 0, "train.global_batch",
           f"{t.global_batch} is not divisible by micro_batch*dp = {t.micro_batch}*{dp}",
           f"choose a multiple of {t.micro_batch * dp}")
    from tessera.optim.microbatches import MicroBatchCalculator  # late: that package imports torch
    MicroBatchCalculator.from_config(t, dp)  # checks every ramp-up batch divides into micro-batches
    _check(not p.sequence_parallel or m.seq_len % p.tp == 0, "model.seq_len",
           f"{m.seq_len} is not divisible by tp={p.tp}, which sequence parallelism needs",
           f"choose seq_len as a multiple of {p.tp} or turn parallel.sequence_parallel off")
    _check(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel",
           "sequence parallelism needs tp > 1", "set parallel.tp >= 2 or turn it off")
    _check(p.vpp == 1 or p.pp > 1, "parallel.vpp", "vpp > 1 needs pp >= 2 (model chunks interleave over stages)",
           "set parallel.vpp=1 or parallel.pp >= 2")
    _check(p.pp <= m.layers, "parallel.pp", f"pp={p.pp} exceeds model.layers={m.layers}",
           "use at most one stage per layer")
    zb = p.schedule in SPLIT_BACKWARD
    _check(not (p.zero == 3 and zb), "parallel.schedule",
           f"{p.schedule} defers weight gradients past the backward that FSDP (zero=3) reduces them in",
           "use parallel.schedule=1f1b or interleaved with zero=3, or zero <= 1")
    _check(p.tp_async == "false" or (p.tp > 1 and p.sequence_parallel), "parallel.tp_async",
           "async TP fuses sequence-parallel all-gathers and reduce-scatters with the GEMMs",
           "set parallel.tp >= 2 and parallel.sequence_parallel=true, or parallel.tp_async=false")
    _check(not (zb and p.pp < 2), "parallel.schedule",
           f"{p.schedule} fills pipeline bubbles; with pp=1 there are none", "use parallel.schedule=none (or auto) with pp=1")
    _check(not (t.grad_accum_fusion == "true" and p.zero == 3), "train.grad_accum_fusion",
           "zero=3 (FSDP) owns the gradients; there is no main_grad to fuse into",
           "set train.grad_accum_fusion=false with parallel.zero=3")
    _check(not (p.zero == 2 and zb), "parallel.schedule",
           f"{p.schedule} holds every zero=2 gradient bucket open from a micro-batch's I step to its W step, "
           "which needs more gradient memory than zero=1",
           f"use parallel.schedule=1f1b or interleaved with zero=2, or zero=1 with {p.schedule}")
    _check(p.grad_reduce_dtype == "fp32" or p.zero < 3, "parallel.grad_reduce_dtype",
           "FSDP (zero=3) reduces in fp32 here", "set parallel.grad_reduce_dtype=fp32 with parallel.zero=3")
    _check(t.grad_dtype == "fp32" or p.zero < 3, "train.grad_dtype",
           "bf16 gradients are a bucket option (zero 0-2); FSDP reduces in fp32",
           "set train.grad_dtype=fp32 with parallel.zero=3")
    _check(t.fused_elementwise != "true" or cfg.model.family == "llama", "train.fused_elementwise",
           "compiles the llama family's RMSNorm, RoPE and SwiGLU; gpt2's LayerNorm and GELU are one "
           "kernel each already", "set train.fused_elementwise=false for model.family=gpt2")
    _check(cfg.data.eod_id < m.vocab_size, "data.eod_id",
           f"{cfg.data.eod_id} is outside model.vocab_size={m.vocab_size}",
           "give the end-of-document id your preprocessing appended (`tessera preprocess` prints it)")
    if p.tp_microbatch_pairs == "true":
        _check_microbatch_pairs(cfg)
    if p.tp_pairs_backward != "threads":
        _check(p.tp_microbatch_pairs == "true", "parallel.tp_pairs_backward",
               f"{p.tp_pairs_backward} orders micro-batch pairs' backwards, and pairs are off "
               f"(parallel.tp_microbatch_pairs={p.tp_microbatch_pairs})",
               "set parallel.tp_microbatch_pairs=true, or leave parallel.tp_pairs_backward at threads")
        _check(p.zero != 2, "parallel.tp_pairs_backward", "zero=2 runs a pair's two backwards one after the other "
               "(its reduction rounds take one micro-batch's gradients at a time): there is nothing to interleave",
               "use parallel.zero 0 or 1, or leave parallel.tp_pairs_backward at threads")
    if t.cuda_graphs == "true":
        _check_cuda_graphs(cfg, dp)
    p.dp = dp
    return cfg


def _check_microbatch_pairs(cfg: Config) -> None:
    """What parallel.tp_microbatch_pairs cannot run with (training/concurrent.py says why)."""
    p, t = cfg.parallel, cfg.train
    key, off = "parallel.tp_microbatch_pairs", "or leave parallel.tp_microbatch_pairs at auto (off)"
    _check(p.tp > 1, key, f"pairs hide TP collectives, and tp={p.tp} has none", f"use parallel.tp > 1 {off}")
    _check(p.pp == 1, key, f"pairs run pp=1 steps; pp={p.pp} runs a pipeline schedule", f"use parallel.pp=1 {off}")
    _check(t.compile != "true", key, "compiled layers call the TP collectives by the group's name, fixed when "
           "compiled, so the second micro-batch cannot take its own communicator", f"leave train.compile at auto {off}")
    _check(t.grad_accum_fusion != "true", key, "fused weight-gradient GEMMs add straight into the main gradients, "
           "and a pair's two streams would add into one at once (not ordered per layer yet, eager or graphed)",
           f"leave train.grad_accum_fusion at auto {off}")
    _check(p.zero < 3, key, "zero=3 (FSDP) gathers and frees each layer's parameters around every forward",
           f"use parallel.zero 0, 1 or 2 {off}")
    _check(t.recompute == "none", key, "a recomputed layer reruns its forward in the backward, outside the "
           "pair's swap of the second micro-batch's TP communicator (its collectives would go over the first's)",
           f"set train.recompute=none {off}")
    _check(p.tp_async == "false", key, "the fused and ring TP collectives (parallel.tp_async) were not built "
           "for two communicators", f"set parallel.tp_async=false {off}")


def can_graph_layers(cfg: Config) -> bool:
    """Whether per-layer CUDA graphs can capture this validated configuration's layers (its
    parallel.dp resolved); the device is the trainer's to check."""
    if cfg.parallel.dp < 1:
        raise ValueError("can_graph_layers needs a validated config (parallel.dp resolved): call validate first")
    try:
        _check_cuda_graphs(cfg, cfg.parallel.dp)
    except ConfigError:
        return False
    return True


def _check_cuda_graphs(cfg: Config, dp: int) -> None:
    """What per-layer CUDA graphs cannot capture (training/cuda_graphs.py says why)."""
    p, m, t, d = cfg.parallel, cfg.model, cfg.train, cfg.data
    fix = "or set train.cuda_graphs=auto (off where it cannot capture) or false"
    _check(p.pp == 1, "train.cuda_graphs", "a layer's graph holds one micro-batch's activations; "
           f"pp={p.pp} keeps several in flight", f"use parallel.pp=1 {fix}")
    _check(p.schedule in ("auto", "none", "1f1b"), "train.cuda_graphs",
           f"schedule {p.schedule} runs several forwards before their backwards, and each graphed layer "
           "keeps one micro-batch's activations", f"use parallel.schedule=auto (none at pp=1) {fix}")
    _check(m.dropout == 0, "train.cuda_graphs", "dropout's random streams are not captured",
           f"set model.dropout=0 {fix}")
    _check(t.recompute == "none", "train.cuda_graphs", "a graphed layer's backward does not run its forward "
           "again (train.recompute)", f"set train.recompute=none {fix}")
    _check(not (d.reset_position_ids or d.reset_attention_mask), "train.cuda_graphs",
           "packed sequences give every micro-batch its own positions and document layout",
           f"turn data.reset_position_ids and data.reset_attention_mask off {fix}")
    _check(t.compile != "true", "train.cuda_graphs", "graphed layers run eagerly, not compiled",
           f"leave train.compile at auto or false {fix}")
    _check(not (t.grad_accum_fusion == "true" and p.zero == 2), "train.cuda_graphs",
           "with train.grad_accum_fusion=true the graphs replay weight-gradient GEMMs into the gradient "
           "buffers, and zero=2 keeps each bucket's buffer only until its reduction",
           f"use parallel.zero=0 or 1, or train.grad_accum_fusion=false {fix}")
    _check(p.zero < 3, "train.cuda_graphs", "zero=3 (FSDP) gathers and frees each layer's parameters "
           "in forward hooks around it, and a graph reads the storage it was captured with",
           f"use parallel.zero 0, 1 or 2 {fix}")


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def field_docs() -> dict[str, str]:
    """``{"section.key": docstring}`` read from the docstrings under each field in this file."""
    import ast
    import inspect

    docs = {}
    for section, cls in SECTIONS.items():
        body = ast.parse(inspect.getsource(cls)).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[f"{section}.{node.target.id}"] = " ".join(after.value.value.split())
    return docs


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the dataclasses."""
    docs, defaults = field_docs(), to_dict(Config())
    lines = ["# Configuration reference", "",
             "Generated by `python -m tessera config` from `src/tessera/config.py`; a test keeps it in sync.",
             "Set keys in a TOML file (`[section]` tables) or with `--set section.key=value`.", ""]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        lines += [f"## [{section}]", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            kind = (" \\| ".join(map(str, typing.get_args(hint))) if typing.get_origin(hint) is Literal
                    else hint.__name__)
            lines.append(f"| `{section}.{f.name}` | {kind} | `{defaults[section][f.name]!r}` | "
                         f"{docs[f'{section}.{f.name}']} |")
        lines.append("")
    return "\n".join(lines)
