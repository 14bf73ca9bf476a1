"""``tessera plan``: the layouts of a config on N GPUs that fit their memory, fastest first, and
why each of the others does not.

Every layout (tp, cp, pp, vpp, dp, zero, recompute, micro-batch, optimizer offload; sequence parallelism on where
tp > 1, every other setting the config's) is checked by the trainer's own preflight
(``preflight.validate``, ``check_pipeline``: a refusal is the error a run would stop with),
planned for CUDA (``make_plan``: the schedule ``auto`` picks), and its peak per rank predicted by
``memory_model.py``. A layout fits when its largest rank's peak is at most the GPU's memory less a
headroom (the CUDA context, NCCL's buffers and the allocator's fragmentation, which the model
leaves out).

The step time is a model with stated numbers, for ranking, not a measurement:

- **compute**: a chunk's forward is its FLOPs (models/flops.py: the layers' GEMMs and causal
  attention over tp, the head's on the last stage) at ``mfu`` of the GPU's peak; a backward twice
  that (I and W one forward each); full recomputation adds the recomputed layers' forward,
  selective the bytes its rerun rebuilds, read and written once at the memory bandwidth;
- **tp**: each layer's collectives per micro-batch (all-reduce, or all-gather and reduce-scatter
  under SP: (t-1)/t of the tensor each way, twice for an all-reduce), four forward, four backward,
  three more where a recomputed layer reruns its forward; synchronous, so on the critical path;
- **cp**: the ring's K/V blocks (forward) and K/V blocks with fp32 gradient accumulators
  (backward), cp-1 steps, hidden behind attention's compute where that takes longer;
- **pp**: the simulator runs the schedule's lists with those per-chunk costs (the slowest chunk's),
  each stage boundary a message of one micro-batch's activations;
- **dp** (over dp x cp, which replicate the weights): gradient all-reduce (zero 0), reduce-scatter
  and parameter all-gather (zero 1, 2), per micro-batch gathers and reduce-scatters (zero 3), each
  hidden behind the backward (or forward) it overlaps except where it takes longer;
- **host**: a micro-batch's kernels are launched by the host, ahead of the GPU: each chunk's
  forward and backward take the longer of their GPU time and their share of
  ``host_per_microbatch`` (a third for the forward), times ``HOST_RECOMPUTE`` for the backward's
  replayed forward;
- **optimizer**: AdamW on the GPU reads and writes ``OPTIMIZER_BYTES`` per element at the memory
  bandwidth; offloaded (``parallel.optimizer_offload``), the gradients down and the parameters up
  over PCIe beside the CPU's AdamW at the host memory's bandwidth (the copies of one range overlap
  the update of another: the longer of the two), after the backward.

The defaults are fitted to one H200 (BENCHMARKS.md, "The memory model against the card", measured
2026-12-01, eager layers, ten configurations of GPT-1.3B and Llama-1B shapes and a Llama-3-8B shape
with offload): ``mfu`` 0.53 from the GPU-bound micro-batch-8 rows (GPT-1.3B 0.55, Llama-1B 0.51 of
the 989 TFLOP/s peak, eager layers; compiled ones measured 51.5-53.3 %); ``host_per_microbatch``
49 ms from the micro-batch-1 rows (0.104 and 0.114 s steps of two micro-batches: GPT's 24 layers
and Llama's 16 alike, so the host's time is not per layer), selective recomputation's 2.3 times
that from GPT's micro-batch-2 row (its checkpoint policy runs for every op), full recomputation's
4/3 assumed (the forward's launches once more; not measured apart); offload's 77 GB/s of host
memory from the five offload rows (0.34-0.38 ns per element for the step, the copies beside it).

A collective's bandwidth is ``node_bandwidth`` where its group lies inside one node of
``gpus_per_node`` (ranks are laid out tp fastest, then cp, dp, pp: topology.py), else
``network_bandwidth``.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field

import torch

from tessera.config import Config, ConfigError
from tessera.models.flops import head_matmul_weights, layer_flops_per_token
from tessera.pipeline_parallel.schedules import build_all
from tessera.pipeline_parallel.simulator import Costs, simulate
from tessera.training.memory_model import (Prediction, activations_for, optimizer_elements, predict_ranks, rank_chunks,
                                           rank_parameters)
from tessera.training.plan import ExecutionPlan, choose_schedule, make_plan, microbatches
from tessera.training.preflight import check_pipeline, validate

UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
         "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_memory(text: str) -> int:
    """'80GB', '80 GiB', '141g', '81920MiB' -> bytes. Binary units: GB = GiB = 2^30 bytes, as
    nvidia-smi and torch count a GPU's memory."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS or unit == "":
        raise ValueError(f"'{text}' is not an amount of memory: give a number and a unit, e.g. 80GB or 141GiB "
                         "(binary units: GB = GiB = 2^30 bytes; MB, TB likewise)")
    value = float(match.group(1)) * UNITS[unit]
    if value <= 0:
        raise ValueError(f"'{text}' is no memory at all: give the GPU's memory, e.g. 80GB")
    return int(value)


@dataclass(frozen=True)
class Machine:
    """The GPUs the plan is for, and the step-time model's numbers."""

    gpus: int
    memory: int  # bytes per GPU
    headroom: float = 0.1  # of the memory, kept free for what the model does not count
    gpus_per_node: int = 8
    peak_flops: float = 989.4e12  # dense bf16 (H100 / H200 SXM)
    mfu: float = 0.53
    node_bandwidth: float = 300e9  # bytes/s a collective reaches inside a node (NVLink)
    network_bandwidth: float = 40e9  # bytes/s per GPU across nodes
    hbm_bandwidth: float = 3.35e12  # bytes/s
    pcie_bandwidth: float = 50e9  # bytes/s each way between a GPU and pinned host memory (offload)
    host_bandwidth: float = 77e9  # bytes/s of host memory one GPU's CPU AdamW reaches (offload)
    host_per_microbatch: float = 0.049  # s the host takes to launch one micro-batch's forward and backward

    @property
    def usable(self) -> float:
        return self.memory * (1 - self.headroom)

    @property
    def unit(self) -> tuple[str, int]:
        """The unit sizes are printed in: GiB, or MiB for a GPU under 1 GiB."""
        return ("GiB", 2**30) if self.memory >= 2**30 else ("MiB", 2**20)


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    vpp: int
    dp: int
    zero: int
    recompute: str
    micro_batch: int
    offload: bool = False

    def __str__(self) -> str:
        return (f"tp={self.tp} pp={self.pp} vpp={self.vpp} cp={self.cp} dp={self.dp} zero={self.zero} "
                f"recompute={self.recompute} micro_batch={self.micro_batch} offload={str(self.offload).lower()}")

    def config(self, base: Config) -> Config:
        cfg = Config(model=base.model, parallel=copy.copy(base.parallel), train=copy.copy(base.train),
                     optim=base.optim, data=base.data, checkpoint=base.checkpoint)  # (only these two change)
        p, t = cfg.parallel, cfg.train
        p.tp, p.cp, p.pp, p.vpp, p.dp, p.zero = self.tp, self.cp, self.pp, self.vpp, 0, self.zero
        p.sequence_parallel = self.tp > 1
        t.recompute, t.micro_batch = self.recompute, self.micro_batch
        p.optimizer_offload = self.offload
        t.recompute_layers = 0
        p.schedule, p.pp_layout = "auto", "auto"  # (what the trainer picks for the layout)
        return cfg


@dataclass
class Verdict:
    layout: Layout
    fits: bool = False
    refused: ConfigError | None = None
    peak: Prediction | None = None
    step_time: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    schedule: str = ""


def _powers(limit: int) -> list[int]:
    return [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= limit]


def layouts(cfg: Config, gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every layout of ``gpus`` GPUs tried: tp up to a node, cp and micro-batches in powers of
    two, pp any divisor, vpp 1, 2 or 4, every zero and recompute mode, optimizer offload on and
    off (zero 0-2)."""
    out = []
    for tp in _powers(min(gpus, gpus_per_node)):
        for cp in _powers(gpus // tp):
            for pp in (n for n in range(1, gpus // (tp * cp) + 1) if (gpus // (tp * cp)) % n == 0):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                for vpp in ((1, 2, 4) if pp > 1 else (1,)):
                    for zero in ((0, 1, 2, 3) if dp * cp > 1 else (0,)):
                        for recompute in ("none", "selective", "full"):
                            for mb in _powers(max(1, cfg.train.global_batch // dp)):
                                for offload in ((False, True) if zero < 3 else (False,)):
                                    out.append(Layout(tp, cp, pp, vpp, dp, zero, recompute, mb, offload))
    return out


def check(layout: Layout, base: Config, gpus: int, seen: dict | None = None) -> tuple[Config, ExecutionPlan]:
    """The layout's config, checked as a run would be (ConfigError where refused), and its plan on
    CUDA. ``seen``: the pipeline checks of earlier layouts (they depend on pp, vpp, the micro-batch
    count and zero only)."""
    cfg = validate(layout.config(base), gpus)
    key = (layout.pp, layout.vpp, microbatches(cfg), layout.zero)
    if seen is None or key not in seen:
        try:
            check_pipeline(cfg)
            result = None
        except ConfigError as e:
            result = e
        if seen is not None:
            seen[key] = result
    else:
        result = seen[key]
    if result is not None:
        raise result
    if seen is None:
        return cfg, make_plan(cfg, torch.device("cuda"))
    # the plan depends on these and on the base config (training/plan.py's rules); auto's schedule
    # (simulated) on the first four only
    key = ("plan", layout.pp, layout.vpp, microbatches(cfg), layout.zero, layout.tp, layout.cp, layout.recompute)
    if key not in seen:
        p = cfg.parallel
        p.schedule = _schedule(p.pp, p.vpp, microbatches(cfg), p.zero)
        seen[key] = make_plan(cfg, torch.device("cuda"))
        p.schedule = "auto"
    return cfg, seen[key]


@functools.lru_cache(maxsize=1024)
def _schedule(pp: int, vpp: int, m: int, zero: int) -> str:
    return choose_schedule("auto", pp, vpp, m, zero)


HOST_RECOMPUTE = {"none": 1.0, "selective": 2.3, "full": 4 / 3}  # a micro-batch's host time, by recompute mode
OPTIMIZER_BYTES = 40  # per element: AdamW's 28, the 16-bit model's copy, the norm's read, the gradient's zeroing


# -- the step-time model -------------------------------------------------------------------------------
def _bandwidth(machine: Machine, span: int) -> float:
    """A collective over a group whose ranks lie within ``span`` consecutive ranks."""
    return machine.node_bandwidth if span <= machine.gpus_per_node else machine.network_bandwidth


def step_time(cfg: Config, plan: ExecutionPlan, machine: Machine) -> dict[str, float]:
    """The model's step time (seconds) and its parts: compute, tp, cp, dp exposed, the pipeline's step."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    act = activations_for(cfg, plan)
    tokens, B = act.tokens, act.bytes
    rate = machine.peak_flops * machine.mfu
    layer_fwd = layer_flops_per_token(m) / 3 * tokens / p.tp / rate
    head_fwd = 2 * head_matmul_weights(m) * tokens / p.tp / rate
    tensor = tokens * m.hidden * B
    tp_bw = _bandwidth(machine, p.tp)
    per_collective = tensor * (p.tp - 1) / p.tp / tp_bw * (1 if p.sequence_parallel else 2)
    tp_fwd = 4 * per_collective if p.tp > 1 and p.sequence_parallel else 2 * per_collective if p.tp > 1 else 0.0
    rerun = {"none": 0.0, "full": layer_fwd + 0.75 * tp_fwd,
             "selective": 2 * (act.layer_total("none") - act.layer_total("selective")) / machine.hbm_bandwidth
             + 0.75 * tp_fwd}[t.recompute]
    cp_fwd = cp_bwd = 0.0
    if p.cp > 1:
        block = 2 * tokens * m.num_kv_heads * m.head_dim / p.tp
        cp_bw = _bandwidth(machine, p.tp * p.cp)
        attention = 2 * tokens * m.seq_len * m.hidden / p.tp / rate / 2  # (causal: half the pairs)
        cp_fwd = max(0.0, (p.cp - 1) * block * B / cp_bw - attention)
        cp_bwd = max(0.0, (p.cp - 1) * block * (B + 4) / cp_bw - 2 * attention)
    costs = []
    last = p.pp * p.vpp - 1
    host_fwd = machine.host_per_microbatch / 3 / p.vpp
    for r in range(p.pp):
        for stage, layers in rank_chunks(cfg, r):
            n = len(layers)
            recomputed = n if t.recompute != "none" and not t.recompute_layers else min(n, t.recompute_layers)
            fwd = n * (layer_fwd + tp_fwd + cp_fwd) + (head_fwd if stage == last else 0.0)
            bwd = 2 * n * layer_fwd + n * (tp_fwd + cp_bwd) + recomputed * rerun + (2 * head_fwd if stage == last else 0.0)
            replayed = HOST_RECOMPUTE[t.recompute] if recomputed else 1.0
            host_bwd = machine.host_per_microbatch * replayed / p.vpp - host_fwd
            costs.append((max(fwd, host_fwd), max(bwd, host_bwd)))
    fwd, bwd = max(c[0] for c in costs), max(c[1] for c in costs)
    hop = tensor / (p.tp if p.sequence_parallel else 1) / _bandwidth(machine, p.tp * p.cp * p.dp * p.pp)
    count = microbatches(cfg)
    if p.pp == 1:
        pipeline = count * (fwd + bwd)
    else:
        pipeline = fwd * _pipeline_step(plan.schedule, p.pp, p.vpp, count, round(bwd / fwd, 2), round(hop / fwd, 2))
    dp_exposed = _dp_exposed(cfg, machine, fwd * p.vpp, bwd * p.vpp, count)
    elements = max(optimizer_elements(cfg, r) for r in range(p.pp))
    offload = _offload_time(elements, machine) if p.optimizer_offload else 0.0
    optimizer = 0.0 if p.optimizer_offload else elements * OPTIMIZER_BYTES / machine.hbm_bandwidth
    return {"step": pipeline + dp_exposed + offload + optimizer, "compute": count * p.vpp * (fwd + bwd),
            "pipeline": pipeline, "dp": dp_exposed, "offload": offload, "optimizer": optimizer}


def _offload_time(elements: int, machine: Machine) -> float:
    """The offloaded optimizer step, after the backward: the fp32 gradients of this rank's optimizer
    elements to the host and the parameters back over PCIe, beside AdamW's 28 bytes per element
    (parameter, gradient, two moments read; three written) of host memory (the copies of the next
    range run while the CPU updates this one, so the longer of the two)."""
    return elements * max(8 / machine.pcie_bandwidth, 28 / machine.host_bandwidth)


@functools.lru_cache(maxsize=4096)
def _pipeline_step(kind: str, pp: int, vpp: int, m: int, backward: float, hop: float) -> float:
    """The simulated step in units of a chunk's forward, its backward and a message given in those
    units (to 1 %: layouts share simulations)."""
    costs = Costs(F=1.0, B=backward, I=backward / 2, W=backward / 2, comm=hop)
    return simulate(build_all(kind, pp, vpp, m), vpp, costs).step_time


def _dp_exposed(cfg: Config, machine: Machine, fwd: float, bwd: float, count: int) -> float:
    """Data parallelism's communication left uncovered by the compute it overlaps."""
    p, t = cfg.parallel, cfg.train
    d = p.dp * p.cp
    if d == 1:
        return 0.0
    params = max(sum(q.numel for chunk in rank_parameters(cfg, r) for q in chunk) for r in range(p.pp))
    bw = _bandwidth(machine, p.tp * p.cp * p.dp)
    share = (d - 1) / d
    pbytes = 2 if t.dtype != "fp32" else 4
    gbytes = 2 if t.grad_dtype == "bf16" else 4
    if p.zero == 3:
        per_microbatch = share * params * (2 * pbytes + 4) / bw
        return count * max(0.0, per_microbatch - (fwd + bwd))
    if p.zero == 0:
        return max(0.0, 2 * share * params * gbytes / bw - bwd)
    return max(0.0, share * params * gbytes / bw - bwd) + max(0.0, share * params * pbytes / bw - fwd)


# -- the plan ----------------------------------------------------------------------------------------------
def plan_layouts(base: Config, machine: Machine) -> list[Verdict]:
    """Every layout's verdict: refused (by the preflight), over memory, or fitting with a step time."""
    out, seen = [], {}
    for layout in layouts(base, machine.gpus, machine.gpus_per_node):
        verdict = Verdict(layout)
        try:
            cfg, plan = check(layout, base, machine.gpus, seen)
        except ConfigError as e:
            verdict.refused = e
            out.append(verdict)
            continue
        verdict.schedule = plan.schedule
        verdict.peak = max(predict_ranks(cfg, plan), key=lambda x: x.total)
        verdict.fits = verdict.peak.total <= machine.usable
        if verdict.fits:
            verdict.parts = step_time(cfg, plan, machine)
            verdict.step_time = verdict.parts["step"]
        out.append(verdict)
    return out


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def rank_key(v: Verdict) -> tuple:
    """Fastest first; where the model's times tie (to 0.1 %: its compute is linear in the tokens
    and hidden communication costs nothing), the simpler layout: lower zero, less recomputation,
    larger micro-batches (GEMMs nearer their peak), no offload, then less memory."""
    return (float(f"{v.step_time:.3g}"), v.layout.zero, RECOMPUTE_ORDER[v.layout.recompute], -v.layout.micro_batch,
            v.layout.offload, v.peak.total)


def render(base: Config, machine: Machine, verdicts: list[Verdict], top: int = 10, every: bool = False) -> str:
    """The plan as text: the fitting layouts, fastest first, then the others grouped by reason."""
    unit, gib = machine.unit
    fits = sorted((v for v in verdicts if v.fits), key=rank_key)
    tokens = base.train.global_batch * base.model.seq_len
    lines = [f"tessera plan: {base.model.family}, {base.model.layers} layers, hidden {base.model.hidden}, "
             f"global batch {base.train.global_batch} x {base.model.seq_len} tokens, {base.train.dtype}; "
             f"{machine.gpus} GPU{'s' if machine.gpus > 1 else ''} of {machine.memory / gib:.1f} {unit} ({machine.usable / gib:.1f} {unit} usable: "
             f"{machine.headroom:.0%} headroom)",
             f"step time model: {machine.mfu:.0%} MFU of {machine.peak_flops / 1e12:.1f} TFLOP/s, "
             f"{machine.node_bandwidth / 1e9:g} GB/s inside a node of {machine.gpus_per_node} GPUs, "
             f"{machine.network_bandwidth / 1e9:g} GB/s across nodes, {machine.hbm_bandwidth / 1e9:g} GB/s memory, "
             f"offload {machine.pcie_bandwidth / 1e9:g} GB/s PCIe and {machine.host_bandwidth / 1e9:g} GB/s host "
             f"memory, {machine.host_per_microbatch * 1e3:g} ms of host time per micro-batch (fitted to one H200: "
             "training/planner.py)", ""]
    if fits:
        lines.append(f"fit ({len(fits)} of {len(verdicts)} layouts), fastest first:")
        lines.append(f"  {'#':>3}  {'tp':>2} {'pp':>2} {'vpp':>3} {'cp':>2} {'dp':>3} {'zero':>4} {'recompute':<9} "
                     f"{'mb':>3} {'offload':>7}  {'schedule':<14} {'peak ' + unit:>8} {'host ' + unit:>8} {'step s':>8} "
                     f"{'tokens/s':>10}")
        for i, v in enumerate(fits[:top], 1):
            lay = v.layout
            lines.append(f"  {i:>3}  {lay.tp:>2} {lay.pp:>2} {lay.vpp:>3} {lay.cp:>2} {lay.dp:>3} {lay.zero:>4} "
                         f"{lay.recompute:<9} {lay.micro_batch:>3} {'yes' if lay.offload else 'no':>7}  "
                         f"{v.schedule:<14} {v.peak.total / gib:>8.1f} {v.peak.state.host / gib:>8.1f} "
                         f"{v.step_time:>8.3f} {tokens / v.step_time:>10,.0f}")
        if len(fits) > top:
            lines.append(f"  ... and {len(fits) - top} slower (--top N shows more)")
    else:
        lines.append(f"no layout fits {machine.usable / gib:.1f} {unit} per GPU")
    others = [v for v in verdicts if not v.fits]
    if others:
        lines += ["", f"do not fit ({len(others)}), by reason:"]
        lines += _reasons(others, machine, every)
    return "\n".join(lines)


FIELDS = ("tp", "pp", "vpp", "cp", "dp", "zero", "recompute", "micro_batch", "offload")


def describe(layouts: list[Layout]) -> str:
    """Several layouts in one phrase: each field's value, or its values joined by '/' where they differ."""
    parts = []
    for name in FIELDS:
        values = sorted({getattr(lay, name) for lay in layouts}, key=lambda x: (RECOMPUTE_ORDER.get(x, 0), x))
        parts.append(f"{name}={'/'.join(str(x).lower() if isinstance(x, bool) else str(x) for x in values)}")
    return " ".join(parts)


def _over_memory(v: Verdict, machine: Machine) -> str:
    (unit, gib), peak = machine.unit, v.peak
    return (f"{peak.total / gib:.1f} {unit} > {machine.usable / gib:.1f} (state {peak.state.total / gib:.1f}, "
            f"activations {peak.activations / gib:.1f} with {peak.in_flight} micro-batch chunk"
            f"{'s' if peak.in_flight != 1 else ''} in flight, temporaries {peak.temporaries / gib:.1f}; "
            f"pipeline rank {peak.pp_rank})")


def _reasons(others: list[Verdict], machine: Machine, every: bool) -> list[str]:
    """The layouts that do not fit, one line per group: refusals grouped by the preflight's key and
    problem, layouts over memory by their parallel layout (tp, pp, vpp, cp, dp, zero), each line
    naming the group's least hungry member and its breakdown. ``every`` lists each layout under its group too."""
    groups: dict[tuple, list[Verdict]] = {}
    for v in others:
        lay = v.layout
        key = (("refused", v.refused.key, v.refused.problem) if v.refused is not None
               else ("memory", lay.tp, lay.pp, lay.vpp, lay.cp, lay.dp, lay.zero))
        groups.setdefault(key, []).append(v)
    refused = sorted((k for k in groups if k[0] == "refused"), key=lambda k: (k[1], -len(groups[k])))
    memory = sorted((k for k in groups if k[0] == "memory"), key=lambda k: min(v.peak.total for v in groups[k]))
    out = []
    if refused:
        out.append(f"  refused by the preflight ({sum(len(groups[k]) for k in refused)}):")
    for k in refused:
        members = groups[k]
        out.append(f"    {k[1]}: {k[2]}: {len(members)} layout{'s' if len(members) > 1 else ''} "
                   f"({describe([v.layout for v in members])})")
        if every:
            out += [f"      {v.layout}" for v in members]
    if memory:
        out.append(f"  over memory ({sum(len(groups[k]) for k in memory)}), least hungry first; the smallest "
                   "member of each parallel layout:")
    for k in memory:
        members = groups[k]
        best = min(members, key=lambda v: v.peak.total)
        out.append(f"    {describe([v.layout for v in members])}: {len(members)} layout"
                   f"{'s' if len(members) > 1 else ''}, the smallest (recompute={best.layout.recompute} "
                   f"micro_batch={best.layout.micro_batch} offload={str(best.layout.offload).lower()}) "
                   f"{_over_memory(best, machine)}")
        if every:
            out += [f"      {v.layout}: {_over_memory(v, machine)}" for v in members]
    return out


def no_fit(verdicts: list[Verdict], machine: Machine) -> str | None:
    """The sentence refusing a plan where nothing fits (None where something does)."""
    if any(v.fits for v in verdicts):
        return None
    sized = [v for v in verdicts if v.peak is not None]
    unit, gib = machine.unit
    if not sized:
        return f"no layout of {machine.gpus} GPUs passes the preflight (reasons above)"
    best = min(sized, key=lambda v: v.peak.total)
    return (f"no layout of {machine.gpus} GPUs fits {machine.usable / gib:.1f} {unit} per GPU: the smallest, "
            f"{best.layout}, needs {best.peak.total / gib:.1f} {unit} -> give more GPUs (--gpus), a larger "
            "--gpu-memory, or a smaller model or sequence")


def plan(base: Config, machine: Machine) -> list[Verdict]:
    """The verdicts, or a ConfigError when no layout of ``machine.gpus`` GPUs runs ``base`` at all."""
    if machine.gpus < 1:
        raise ConfigError("--gpus", f"{machine.gpus} is not a number of GPUs", "give 1 or more")
    verdicts = plan_layouts(base, machine)
    if all(v.refused is not None for v in verdicts):
        reasons = sorted({f"{v.refused.key}: {v.refused.problem}" for v in verdicts})
        shown = "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else "")
        raise ConfigError("--gpus", f"no layout of {machine.gpus} GPUs runs this config (every tp x cp x pp x dp "
                          f"product was tried): {shown}", "give a GPU count the model's heads, layers and "
                          "global batch divide among tp, pp and dp (e.g. a power of two)")
    return verdicts


__all__ = ["Machine", "Layout", "Verdict", "parse_memory", "layouts", "plan", "plan_layouts", "render",
           "step_time", "no_fit", "describe"]
