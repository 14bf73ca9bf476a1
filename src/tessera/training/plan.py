"""The execution plan: how this run's steps execute, resolved once from the config and the device.

Every ``"auto"`` of the config is decided here and nowhere else: the pipeline schedule and
layout, compiled layers, CUDA-graphed layers, gradient-accumulation fusion, the compiled
elementwise functions, the TP backward overlap, the fused cross entropy. The trainer prints the
plan's one line at start; the trainer and the benchmarks build from it alike
(``training/build.py``). The rules and the measurements behind them: docs/architecture.md,
"Fast paths", and BENCHMARKS.md, one GPU and tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.config import Config, ConfigError, check, resolve
from tessera.pipeline_parallel.schedules import SPLIT_BACKWARD, build_all, check_kind
from tessera.pipeline_parallel.simulator import simulate
from tessera.pipeline_parallel.stage import parse_layout, stage_layer_ranges


@dataclass(frozen=True)
class ExecutionPlan:
    """What the config's switches resolved to on this device."""

    schedule: str  # the pipeline schedule (none at pp=1)
    layout: tuple[int, ...]  # layers per virtual stage (pp * vpp entries)
    compiled: bool  # each transformer layer torch.compile'd
    graphed: bool  # each transformer layer captured in CUDA graphs
    fuse_wgrad: bool  # weight-gradient GEMMs add into the fp32 main gradients
    fused_elementwise: bool  # llama's RMSNorm, RoPE, SwiGLU as compiled functions in eager layers
    comm_overlap: bool  # a column layer's input-gradient reduction overlaps its weight-gradient GEMM
    fused_cross_entropy: bool  # the compiled vocab-parallel loss
    fp8_weight_cache: bool = False  # tensorwise fp8 weights cast once per step (eager layers only)
    fp8_param_gather: bool = False  # zero=3: FSDP gathers tensorwise fp8 weights as e4m3 bytes (eager layers)

    @property
    def split_backward(self) -> bool:
        """The schedule defers weight gradients (zero-bubble): the layers need a WeightGradStore."""
        return self.schedule in SPLIT_BACKWARD

    def describe(self, cfg: Config) -> str:
        """One line for the run's start."""
        p = cfg.parallel
        layers = "compiled" if self.compiled else "eager"
        parts = [f"schedule {self.schedule}"]
        if p.pp > 1:
            parts.append(f"layers per stage {list(self.layout)} (pp_layout={p.pp_layout})")
        parts.append(f"layers {layers}{' in CUDA graphs' if self.graphed else ''}")
        wgrad = "fused into main_grad" if self.fuse_wgrad else "via autograd"
        parts.append(f"weight gradients {wgrad}{f' (deferred, {self.schedule})' if self.split_backward else ''}")
        if self.comm_overlap and p.tp > 1:
            parts.append("TP backward comm overlapped")
        if self.fused_elementwise:
            parts.append("RMSNorm / RoPE / SwiGLU compiled")
        if cfg.train.fp8 != "none":
            cast = "once per step" if self.fp8_weight_cache else "in the layers' kernels"
            if self.fp8_param_gather:
                cast = "before FSDP's all-gather, gathered as fp8"
            elif p.zero == 3:
                cast += ", FSDP gathering them in train.dtype"
            parts.append(f"fp8 {cfg.train.fp8}, weights cast {cast}")
        return ", ".join(parts)


def microbatches(cfg: Config) -> int:
    """Micro-batches per step and dp rank at the full global batch (``parallel.dp`` resolved)."""
    t = cfg.train
    return t.global_batch // (t.micro_batch * cfg.parallel.dp)


def choose_schedule(kind: str, pp: int, vpp: int, microbatches: int, zero: int = 0) -> str:
    """``kind`` checked, or ``auto`` resolved: none at pp=1; interleaved-zb at vpp > 1; else the
    faster of 1f1b and zb-h1 on the simulator. Never a split backward with zero >= 2: its deferred
    weight gradients would arrive after zero=2's per-micro-batch reductions and FSDP's."""
    if kind != "auto":
        check_kind(kind, pp, vpp, microbatches)
        return kind
    if pp == 1:
        return "none"
    if vpp > 1:
        return "interleaved" if zero >= 2 else "interleaved-zb"
    kinds = ("1f1b",) if zero >= 2 else ("1f1b", "zb-h1")
    return min(kinds, key=lambda k: simulate(build_all(k, pp, 1, microbatches)).step_time)


def check_graphable(cfg: Config, schedule: str) -> None:
    """Refuse what per-layer CUDA graphs cannot capture (training/cuda_graphs.py says why)."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    key, fix = "train.cuda_graphs", "or set train.cuda_graphs=auto (off where it cannot capture) or false"
    check(p.pp == 1, key, f"a layer's graph holds one micro-batch's activations; pp={p.pp} keeps several in "
          "flight", f"use parallel.pp=1 {fix}")
    check(schedule in ("none", "1f1b"), key, f"schedule {schedule} runs several forwards before their backwards, "
          "and each graphed layer keeps one micro-batch's activations", f"use parallel.schedule=auto (none at "
          f"pp=1) {fix}")
    check(p.cp == 1, key, f"ring attention (cp={p.cp}) exchanges its key and value blocks from Python, step by "
          "step", f"use parallel.cp=1 {fix}")
    check(cfg.model.dropout == 0, key, "dropout's random streams are not captured", f"set model.dropout=0 {fix}")
    check(t.recompute == "none", key, "a graphed layer's backward does not run its forward again (train.recompute)",
          f"set train.recompute=none {fix}")
    check(not (d.reset_position_ids or d.reset_attention_mask), key,
          "packed sequences give every micro-batch its own positions and document layout",
          f"turn data.reset_position_ids and data.reset_attention_mask off {fix}")
    check(t.compile is not True, key, "graphed layers run eagerly, not compiled", f"leave train.compile at auto or "
          f"false {fix}")
    check(not (t.grad_accum_fusion is True and p.zero == 2), key, "with train.grad_accum_fusion=true the graphs "
          "replay weight-gradient GEMMs into the gradient buffers, and zero=2 keeps each bucket's buffer only "
          "until its reduction", f"use parallel.zero=0 or 1, or train.grad_accum_fusion=false {fix}")
    check(p.zero < 3, key, "zero=3 (FSDP) gathers and frees each layer's parameters in forward hooks around it, "
          "and a graph reads the storage it was captured with", f"use parallel.zero 0, 1 or 2 {fix}")


def _graphable(cfg: Config, schedule: str) -> bool:
    try:
        check_graphable(cfg, schedule)
    except ConfigError:
        return False
    return True


def make_plan(cfg: Config, device: torch.device, tp: int | None = None) -> ExecutionPlan:
    """Resolve the config's switches for ``device`` (``cfg`` validated: ``parallel.dp`` set).
    Explicit true / false stand; each auto follows the rule beside it. ``tp``: the tp size of the
    rank's own layers (its stage's under ``parallel.stage_tp``; by default the largest stage's,
    or ``parallel.tp``): the layer-level choices follow the layers the rank runs."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    cuda = device.type == "cuda"
    tp = tp or (max(p.stage_tp) if p.stage_tp else p.tp)
    schedule = choose_schedule(p.schedule, p.pp, p.vpp, microbatches(cfg), p.zero)
    layout = stage_layer_ranges(m.layers, p.pp, p.vpp, parse_layout(p.pp_layout, m, p.pp, p.vpp))
    split = schedule in SPLIT_BACKWARD
    # tp > 1: the halved GEMMs leave eager layers bound by the host's launches; graphs replay them
    graphed = resolve(t.cuda_graphs, cuda and tp > 1 and t.compile is not True and _graphable(cfg, schedule))
    # tp = 1: inductor fuses llama's many small elementwise kernels; not around deferred weight
    # gradients (eager layers with compiled elementwise functions measured faster there). fp8
    # layers compile for either family: eager ones launch their casts and amaxes one by one
    # (measured 0.52x of bf16 on Llama-1B; compiled 1.13x on a Llama-3B shape)
    compiled = resolve(t.compile, cuda and tp == 1 and p.cp == 1 and (m.family == "llama" or t.fp8 != "none")
                       and not split and not graphed and t.recompute == "none")
    # tp = 1: one fp32-accumulating GEMM per weight gradient instead of a GEMM and an add; in
    # compiled layers only where auto compiled them (the combination measured for llama)
    fuse = resolve(t.grad_accum_fusion, cuda and tp == 1 and p.zero < 3 and not graphed
                   and (not compiled or t.compile == "auto"))
    elementwise = cuda and not compiled and m.family == "llama" and t.fused_elementwise is not False
    overlap = resolve(p.tp_comm_overlap, graphed and tp > 1)
    # tensorwise: a weight's fp8 copy serves every micro-batch of a step; not under FSDP (zero=3),
    # whose point is not to keep whole weights; not in compiled layers, whose fused casts measured
    # as fast as copies cast once per step and handed in, which held 2 bytes per weight more; not in
    # graphed layers, whose captured casts replay without a lookup
    cache = t.fp8 == "tensorwise" and p.zero < 3 and not compiled and not graphed
    # zero=3, tensorwise: FSDP gathers those weights as fp8 bytes cast under the whole weight's
    # scale (rowwise gathers train.dtype: its backward casts the weight again along other axes;
    # compiled layers too: their graphs would take the gathered weight, a tensor subclass)
    fp8_gather = t.fp8 == "tensorwise" and p.zero == 3 and not compiled
    return ExecutionPlan(schedule=schedule, layout=tuple(len(r) for r in layout), compiled=compiled,
                         graphed=graphed, fuse_wgrad=fuse, fused_elementwise=elementwise, comm_overlap=overlap,
                         fused_cross_entropy=cuda and t.fused_cross_entropy, fp8_weight_cache=cache,
                         fp8_param_gather=fp8_gather)


__all__ = ["ExecutionPlan", "make_plan", "choose_schedule", "check_graphable", "microbatches"]
