"""The six configuration sections as typed dataclasses, each field with its help string, each
section checking its own fields when it is built (a typo or a value out of range is a
:class:`ConfigError` that names the key and the fix)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

from tessera.config.base import AUTO, ConfigError, Switch, check, check_local, resolve  # noqa: F401


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
    gelu: Literal["tanh", "exact"] = "tanh"
    """gpt2's MLP activation: tanh, GPT-2's own approximation (Megatron's --openai-gelu); exact, the
    erf form (Megatron's default for GPT models)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; output projections of each residual
    branch are scaled by 1/sqrt(2*layers) as in GPT-2."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "vocab_pad_multiple", "hidden", "layers", "heads", "seq_len"):
            check(getattr(self, name) > 0, f"model.{name}", "must be positive", "give a value >= 1")
        check(self.kv_heads >= 0, "model.kv_heads", "must be >= 0", "use 0 for kv_heads = heads")
        check(self.ffn_hidden >= 0, "model.ffn_hidden", "must be >= 0", "use 0 for the default width")
        check(self.hidden % self.heads == 0, "model.hidden",
              f"{self.hidden} is not divisible by model.heads={self.heads}", "choose hidden as a multiple of heads")
        check(self.heads % self.num_kv_heads == 0, "model.kv_heads",
              f"model.heads={self.heads} is not a multiple of kv_heads={self.num_kv_heads}",
              "choose kv_heads dividing heads")
        check(0.0 <= self.dropout < 1.0, "model.dropout", f"{self.dropout} is not in [0, 1)",
              "give a probability such as 0.1 (0 disables dropout)")
        check(self.family != "llama" or self.head_dim % 2 == 0, "model.hidden",
              f"hidden/heads = {self.hidden}/{self.heads} = {self.head_dim} is odd; RoPE rotates pairs of channels",
              "choose hidden and heads whose quotient (the head dimension) is even")
        check(self.family == "llama" or self.num_kv_heads == self.heads, "model.kv_heads",
              "grouped-query attention is a llama feature", "set model.family='llama' or kv_heads=0")
        # (a negative epsilon or RoPE base gives NaN losses from the first step, silently)
        check(self.norm_eps >= 1.2e-38, "model.norm_eps", f"{self.norm_eps} is not positive in fp32 "
              "(below 1.2e-38 it rounds to 0 or a subnormal there: 0/0 on an all-zero input)",
              "give a small positive epsilon such as 1e-5")
        check(self.rope_theta > 0, "model.rope_theta", f"{self.rope_theta} is not positive",
              "give a positive base frequency such as 10000")
        check(self.family == "gpt2" or self.gelu == "tanh", "model.gelu", "llama's MLP is SwiGLU, without a GELU",
              "leave model.gelu at tanh for llama")
        check(self.init_std >= 0, "model.init_std", f"{self.init_std} is negative",
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
    """Virtual pipeline stages (model chunks) per rank, for the interleaved schedules."""
    cp: int = 1
    """Context-parallel size: each sample's sequence is split over this many ranks (2*cp chunks,
    rank r holding chunks r and 2*cp-1-r), its attention run as ring attention among them."""
    dp: int = 0
    """Data-parallel size; 0 derives it as world_size / (tp * cp * pp)."""
    sequence_parallel: bool = False
    """Split activations along the sequence inside TP regions (norms, dropout) and replace
    all-reduces by all-gather / reduce-scatter pairs."""
    pp_layout: str = AUTO
    """Layers of each virtual pipeline stage: comma-separated counts (pp*vpp entries, e.g.
    "3,4,4,3"), "even", or "balanced" (by time, the last stage's output head counted as the
    layers it takes). auto: balanced when vpp > 1, else even (BENCHMARKS.md, pipeline parallelism)."""
    schedule: Literal["auto", "none", "gpipe", "1f1b", "interleaved", "zb-h1", "interleaved-zb"] = AUTO
    """Pipeline schedule. zb-h1 and interleaved-zb split the backward into input and weight
    gradients and defer the latter into the bubbles. auto: none at pp=1, interleaved-zb at
    vpp > 1, else the faster of 1f1b and zb-h1 by the simulator (no split backward with zero >= 2)."""
    zero: Literal[0, 1, 2, 3] = 0
    """Data-parallel sharding. 0: gradients all-reduced. 1: fp32 main parameters and Adam states
    sharded over dp (distributed optimizer). 2: gradients sharded too. 3: FSDP (torch
    fully_shard): parameters sharded as well."""
    bucket_size: int = 40_000_000
    """Elements per gradient bucket (zero 0-2); each bucket's reduction starts as soon as its
    gradients are final."""
    overlap_grad_reduce: bool = True
    """zero 0-2: reduce each bucket during the last micro-batch's backward; false: everything after it."""
    overlap_param_gather: bool = True
    """zero 1-2: all-gather the updated parameters after the optimizer step, each bucket awaited
    only by the first forward that reads it; false: gather before the next step."""
    tp_comm_overlap: Switch = AUTO
    """tp > 1: a column-parallel layer's backward overlaps its input gradient's reduction with the
    weight-gradient GEMM. auto: on inside CUDA-graphed layers, where it measured faster."""
    optimizer_offload: bool = False
    """zero 0-2: keep the fp32 main parameters and Adam's moments in (pinned) host memory and run
    AdamW on the CPU; each step copies this rank's gradients to the host and the updated
    parameters back. Frees 12 bytes per optimizer element of GPU memory for host memory and time."""
    offload_staging: int = 0
    """optimizer_offload: gradient elements per copy to the host, two pinned buffers (0: one bucket or shard)."""
    stage_tp: list[int] = field(default_factory=list)
    """Heterogeneous pipeline: the tp size of each pipeline stage (pp entries; empty: parallel.tp
    everywhere). Stage s runs on stage_tp[s]*stage_dp[s] ranks of its own, joined to its
    neighbours by a bridge that re-splits activations (docs/architecture.md, heterogeneous layouts)."""
    stage_dp: list[int] = field(default_factory=list)
    """Heterogeneous pipeline: the dp size of each pipeline stage (pp entries; empty: the same dp
    everywhere). Each pipeline micro-batch (train.micro_batch x the largest stage_dp samples) is
    split over a stage's dp replicas along the batch."""

    def __post_init__(self) -> None:
        check(self.zero in (0, 1, 2, 3), "parallel.zero", f"{self.zero!r} is not 0, 1, 2 or 3",
              "use 0 (replicated), 1 (distributed optimizer), 2 (+ sharded gradients) or 3 (FSDP)")
        check(not (self.optimizer_offload and self.zero == 3), "parallel.optimizer_offload",
              "zero=3 (FSDP) keeps its fp32 shards as the model's own parameters, which the forward gathers "
              "on the GPU, so there is no separate main copy to move to the host",
              "use parallel.zero=1 or 2 with optimizer_offload (each rank offloads its shard), or turn it off")
        check(self.offload_staging >= 0, "parallel.offload_staging", "is negative", "give elements per copy, or 0")
        check(self.bucket_size >= 1, "parallel.bucket_size", "must be >= 1", "give elements per bucket, e.g. 40000000")
        for name in ("tp", "cp", "pp", "vpp"):
            check(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1", "use 1 for no parallelism on this axis")
        check(self.dp >= 0, "parallel.dp", "must be >= 0", "use 0 to derive it from the world size")
        for name in ("stage_tp", "stage_dp"):
            sizes = getattr(self, name)
            check(all(n >= 1 for n in sizes), f"parallel.{name}", f"{sizes} has an entry < 1",
                  "give one size >= 1 per pipeline stage, or leave it empty")
            check(not sizes or len(sizes) == self.pp, f"parallel.{name}",
                  f"{sizes} has {len(sizes)} entries for pp={self.pp} stages", f"give {self.pp} entries, one per stage")
        check(bool(self.stage_tp) == bool(self.stage_dp), "parallel.stage_dp" if self.stage_tp else "parallel.stage_tp",
              "is empty while the other of stage_tp / stage_dp is given",
              "give both parallel.stage_tp and parallel.stage_dp, one entry per stage")


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
    """Precision of the model's parameters and compute; the optimizer keeps fp32 main parameters
    (fp16 with dynamic loss scaling; under zero=3 FSDP keeps fp32 shards and casts to this)."""
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision in which gradients accumulate over micro-batches and travel over dp (zero 0-2);
    bf16 halves the gradient buffer and its reduce-scatter still sums in fp32."""
    out_dir: str = "runs/default"
    """Directory for metrics.jsonl and the run's config.toml."""
    log_every: int = 10
    """Print one console line every this many steps."""
    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard scalars to out_dir/tensorboard/run-N, a
    folder per run (`pip install tensorboard`)."""
    eval_every: int = 0
    """Every this many steps, and after the last, the validation loss over train.eval_batches
    global batches of the validation split (data.split's second part). 0: never."""
    eval_batches: int = 10
    """Global batches of train.global_batch samples each validation loss is taken over."""
    device: Literal["auto", "cpu", "cuda"] = AUTO
    """auto: cuda when available (NCCL), else cpu (gloo)."""
    sample_tokens: int = 0
    """After training, generate this many tokens from sample_prompt and print them (0: none)."""
    sample_prompt: str = "The "
    """Prompt for the sample printed after training."""
    sample_tokenizer: str = ""
    """The sample's tokenizer.json (or a folder holding one); empty: the data's own (bytes for
    the builtin corpus, PREFIX.tokenizer.json beside the first indexed dataset)."""
    compile: Switch = AUTO
    """torch.compile each transformer layer. auto: on for CUDA runs at tp=1 whose schedule does
    not split the backward and whose layers are not recomputed, for the llama family and fp8
    layers. true also under train.recompute=full (the compiled layer runs again in the backward)."""
    grad_accum_fusion: Switch = AUTO
    """A linear layer's weight-gradient GEMM adds straight into the fp32 main gradient (zero 0-2).
    auto: on for CUDA runs at tp=1."""
    cuda_graphs: Switch = AUTO
    """Capture each transformer layer's forward and backward as CUDA graphs and replay them
    (CUDA, pp=1, no dropout, no packed sequences, eager layers, zero 0-2). auto: on at tp > 1
    where the layers can be captured."""
    fused_elementwise: Switch = AUTO
    """The llama family's RMSNorm, RoPE and SwiGLU as compiled functions inside eager layers on
    CUDA. auto: on for llama wherever its layers are not compiled whole."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """The transformer layers' linear GEMMs (QKV, output projection, MLP) in float8 with dynamic
    scales over each whole logical tensor, e4m3 forward and e5m2 gradients: one scale per tensor
    (tensorwise) or per row (rowwise). Embeddings, norms, attention and the head stay in train.dtype;
    a CPU emulates the GEMMs. With parallel.zero=3, tensorwise weights are all-gathered as fp8 bytes
    (rowwise: in train.dtype). none: train.dtype throughout."""
    fused_cross_entropy: bool = True
    """The fused vocab-parallel cross entropy on CUDA (no fp32 copy of the logits); off, or on a
    CPU: the reference ops."""
    timeout_s: float = 300.0
    """A collective that waits this long ends the job; so does a step after the first that takes
    longer than this and five times the slowest step before it (every thread's stack printed)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation, for models that do not fit otherwise (eager layers only). full: a
    recomputed layer keeps only its input and runs its forward again in the backward. selective: it
    also keeps its GEMMs' and attention's outputs and runs only the rest again (norms, RoPE,
    activations, dropout with the same masks, TP collectives): no GEMM or attention kernel twice."""
    recompute_layers: int = 0
    """train.recompute: how many layers of each pipeline chunk, from its first, are recomputed;
    0, or more than a chunk holds: all of them."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A bf16/fp32 step whose gradient norm is inf or nan changes nothing. stop: re-run its batch
    on the same weights and random streams, say whether the fault is reproducible, and stop (exit
    status 3). skip: pass the step over, up to train.max_skipped_steps in a row."""
    skip_spikes: float = 0.0
    """Pass over a step whose gradient norm lies more than this many standard deviations above
    the last train.spike_window applied steps' (decided on the device). 0: off."""
    spike_window: int = 128
    """Applied steps whose gradient norms train.skip_spikes compares a step with."""
    max_skipped_steps: int = 10
    """The run stops after this many skipped steps in a row (non-finite or spikes)."""
    inject_fault_step: int = 0
    """To try the guards: at this step (from 1; 0: never) rank 0 corrupts one of its gradients
    as train.inject_fault says."""
    inject_fault: Literal["nan", "nan_once", "spike", "kill"] = "nan"
    """nan: every time the step runs (reproducible); nan_once: only the first time (transient);
    spike: the gradient times 1e4 (a finite spike); kill: the last rank kills itself (SIGKILL) as
    the step starts, in the job's first attempt only, to try torchrun's --max-restarts."""
    exit_after_minutes: float = 0.0
    """Stop after the step in hand once the job has run this long, save a checkpoint and exit 0,
    as on SIGTERM or SIGUSR1 (e.g. a few minutes before a cluster's time limit). 0: no limit."""
    straggler_every: int = 100
    """Every this many steps, compare each rank's work per step (its phases but the waits for
    other ranks) with its pipeline stage's median and name the slow ones. 0: never."""
    straggler_margin: float = 0.2
    """A rank is a straggler when its work per step exceeds its stage's median by this fraction."""
    batch_rampup: str = ""
    """Global-batch ramp-up as "start,increment,ramp_samples": begin at start samples per step and
    add increment, in equal slices of ramp_samples consumed samples, until global_batch. Empty:
    a constant global_batch."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "global_batch", "steps", "log_every", "eval_batches"):
            check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1", "give a value >= 1")
        check_local("train.out_dir", self.out_dir)
        check_local("train.sample_tokenizer", self.sample_tokenizer)
        check(self.eval_every >= 0, "train.eval_every", f"{self.eval_every} is below 0",
              "give steps between validation losses, or 0 for none")
        check(self.sample_tokens >= 0, "train.sample_tokens", "must be >= 0", "use 0 for no sample")
        check(1 <= self.timeout_s <= 1e9, "train.timeout_s", f"{self.timeout_s} is not in [1, 1e9] seconds "
              "(the process group's setup waits for every rank that long)", "give seconds, e.g. 300")
        check(0 <= self.seed < 2**62, "train.seed", f"{self.seed} is outside [0, 2**62)",
              "give a non-negative seed (numpy's data order takes no negative one; torch's, none of 2**64 or more)")
        check(self.recompute_layers >= 0, "train.recompute_layers", f"{self.recompute_layers} is below 0",
              "give the layers per pipeline chunk to recompute, or 0 for all")
        check(self.recompute != "none" or not self.recompute_layers, "train.recompute_layers",
              "is set but train.recompute=none", "set train.recompute=selective or full")
        check(self.recompute != "selective" or self.compile is not True, "train.compile",
              "true with train.recompute=selective: compiled layers are recomputed whole or not at all",
              "set train.recompute=full, or train.compile=auto or false")
        check(self.max_skipped_steps >= 1, "train.max_skipped_steps", f"{self.max_skipped_steps} is below 1",
              "give the skipped steps in a row to stop after, e.g. 10")
        check(self.inject_fault_step >= 0, "train.inject_fault_step", f"{self.inject_fault_step} is below 0",
              "give the step (from 1) to inject a fault at, or 0 for never")
        check(math.isfinite(self.exit_after_minutes) and self.exit_after_minutes >= 0, "train.exit_after_minutes",
              f"{self.exit_after_minutes} is not a number of minutes >= 0", "give e.g. 235 for a 4-hour limit, or 0")
        check(self.straggler_every >= 0, "train.straggler_every", f"{self.straggler_every} is below 0",
              "give the steps between straggler checks, e.g. 100, or 0 for none")
        check(math.isfinite(self.straggler_margin) and self.straggler_margin > 0, "train.straggler_margin",
              f"{self.straggler_margin} is not a fraction > 0", "give e.g. 0.2 (20 % slower than the median)")
        check(math.isfinite(self.skip_spikes) and self.skip_spikes >= 0, "train.skip_spikes",
              f"{self.skip_spikes} is not a number of standard deviations >= 0", "give e.g. 6, or 0 for off")
        check(self.spike_window >= 2, "train.spike_window", f"{self.spike_window} steps give no standard deviation",
              "give the applied steps to compare with, >= 2 (e.g. 128)")
        rampup = self.rampup
        if rampup is not None:
            start, increment, ramp_samples = rampup
            check(start <= self.global_batch, "train.batch_rampup",
                  f"start {start} exceeds train.global_batch={self.global_batch}", "choose a start batch <= global_batch")
            check(ramp_samples >= 1 or start == self.global_batch, "train.batch_rampup",
                  f"a ramp from {start} to global_batch={self.global_batch} over 0 samples",
                  "give the samples the ramp lasts (>= 1), or leave train.batch_rampup empty for a constant batch")
            check((self.global_batch - start) % increment == 0, "train.batch_rampup",
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
        check(start >= 1 and increment >= 1 and ramp_samples >= 0, "train.batch_rampup",
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
        check(self.lr > 0, "optim.lr", "must be positive", "give a rate such as 3e-4")
        check(0 <= self.min_lr <= self.lr, "optim.min_lr", f"{self.min_lr} is not in [0, optim.lr]",
              f"choose min_lr <= lr = {self.lr}")
        check(self.warmup >= 0, "optim.warmup", "must be >= 0", "use 0 for no warmup")
        check(self.decay_steps >= 0, "optim.decay_steps", "must be >= 0", "use 0 to decay over train.steps")
        check(self.wsd_decay_steps >= 0, "optim.wsd_decay_steps", "must be >= 0", "use 0 for 10% of the decay steps")
        for name in ("weight_decay", "start_weight_decay", "end_weight_decay"):
            check(getattr(self, name) >= 0, f"optim.{name}", "must be >= 0", "use 0 for no weight decay")
        check(self.clip_grad >= 0, "optim.clip_grad", "must be >= 0", "use 0 to disable clipping")
        check(0 <= self.beta1 < 1, "optim.beta1", "must be in [0, 1)", "the usual value is 0.9")
        check(0 <= self.beta2 < 1, "optim.beta2", "must be in [0, 1)", "the usual value is 0.95")
        check(self.eps > 0, "optim.eps", f"{self.eps} is not > 0 (Adam divides by sqrt(v) + eps, and v is 0 "
              "where a gradient has always been 0)", "the usual value is 1e-8")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["builtin", "synthetic", "indexed"] = "builtin"
    """builtin: the demo corpus shipped with Python (pydoc topics), byte tokens. synthetic: seeded
    random tokens. indexed: Megatron .bin/.idx datasets named by data.paths."""
    paths: list[str] = field(default_factory=list)
    """indexed: dataset prefixes (PREFIX.bin / PREFIX.idx), optionally weighted as Megatron's
    ["0.7", "prefixA", "0.3", "prefixB"]; several without weights: one epoch of each, in
    proportion to its samples (of the split drawn from), as megatron-core; on the command line,
    comma-separated. A prefix may be a URL (s3://bucket/corpus): ranged reads through a local
    cache in data.cache_dir."""
    split: str = "969,30,1"
    """Train / valid / test weights; each dataset's documents are split in contiguous ranges,
    megatron-core's: part i is documents [round(a*n), round(b*n)), a and b the running sums of the
    normalised weights."""
    sample_order: Literal["megatron", "epochs"] = "megatron"
    """megatron: megatron-core's GPTDataset and BlendedDataset streams, sample for sample (one
    shuffle of all epochs' documents, then of the samples, a last epoch under 80 % used apart).
    epochs: each epoch shuffled on its own, so a run given more train.steps serves the same
    samples first (in megatron's order the shuffle changes with the number of epochs a run needs)."""
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
        check(self.source != "indexed" or bool(self.paths), "data.paths", "data.source=indexed needs datasets",
              "give data.paths, e.g. --set data.paths=my-corpus_text_document "
              '(in a TOML file: paths = ["my-corpus_text_document"])')
        check_local("data.cache_dir", self.cache_dir)
        packing = self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        check(not packing or self.eod_id >= 0, "data.eod_id",
              "reset_position_ids / reset_attention_mask / eod_mask_loss need the end-of-document id",
              "set data.eod_id (the id your preprocessing appended: `tessera preprocess` and "
              "`tessera data inspect PREFIX` print it)")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str = ""
    """Folder of this run's checkpoints, each ``step_N`` (complete, or not there at all); a run
    resumes from its newest by itself. A URL (s3://bucket/run, gs://...) saves to that object
    store through fsspec (pip install s3fs / gcsfs). Empty: nothing saved."""
    save_every: int = 0
    """Save every this many steps (0: only at the end); the last step is always saved."""
    load: str = ""
    """Start from this checkpoint instead: a ``step_N`` folder, or a folder of them (its
    newest), or such a URL (s3://...); on any layout (tp, pp, vpp, dp, zero) and dtype. Empty:
    checkpoint.dir's newest, if any."""
    finetune: bool = False
    """From checkpoint.load take the model's weights only: Adam, step, data position, schedule
    and batch sizes start afresh."""
    new_schedule: bool = False
    """Resume everything but take the learning-rate and weight-decay schedule from this run's
    optim settings and train.steps, from the resumed step (Megatron's
    --override-opt_param-scheduler). Batch sizes must still match."""
    keep: int = 0
    """Keep only the newest this many checkpoints in checkpoint.dir (0: keep all)."""
    async_save: bool = False
    """Copy each checkpoint to pinned host memory and write it while training goes on; the run
    waits only for the copy. Costs a host copy of each rank's part (~12 bytes per parameter)."""

    def __post_init__(self) -> None:
        for key in ("save_every", "keep"):
            check(getattr(self, key) >= 0, f"checkpoint.{key}", f"{getattr(self, key)} is negative",
                  "give 0 or a positive count")
            check(self.dir or not getattr(self, key), f"checkpoint.{key}", "is set but checkpoint.dir is not",
                  "set checkpoint.dir, the folder checkpoints are saved in")
        check(self.load or not self.finetune, "checkpoint.finetune", "is set but checkpoint.load is not",
              "set checkpoint.load, the checkpoint whose weights the run starts from")
        check(not (self.finetune and self.new_schedule), "checkpoint.new_schedule",
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


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # "model": ModelConfig, ...
