"""One transformer layer built from tensor-parallel pieces: attention, MLP, norms, RoPE.

Activations are ``[s, b, h]`` (sequence first). Under sequence parallelism the residual stream
is ``[s/tp, b, h]``: norms and dropout run on this rank's slice, the column-parallel QKV / fc1
all-gather it and the row-parallel out-projection / fc2 reduce-scatter back to it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.config import ModelConfig
from tessera.models.fused import kernels
from tessera.models.packed import PackedSequence
from tessera.precision.fp8 import Float8Recipe, Float8WeightCache
from tessera.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_sequence_parallel,
    scaled_init_std,
)
from tessera.tensor_parallel.mappings import Group, group_size
from tessera.tensor_parallel.random import RNGTracker


@dataclass
class TPContext:
    """What a layer needs to know about tensor parallelism, handed down explicitly."""

    group: Group = None
    sequence_parallel: bool = False
    cp_group: Group = None  # context parallelism: the ranks sharing each sample's sequence (ring attention)
    fp8: Float8Recipe | None = None  # the layers' linear GEMMs in float8 (precision/fp8.py); the head stays
    fp8_cache: Float8WeightCache | None = None  # their fp8 weights cast once per step (tensorwise)
    rng: RNGTracker | None = None
    fused_cross_entropy: bool | None = None  # the compiled vocab-parallel loss (None: on CUDA only)
    comm_overlap: bool = False  # column layers overlap their input-gradient reduction with the W GEMM
    fused_elementwise: bool = False  # RMSNorm, RoPE, SwiGLU as compiled functions on CUDA (models/fused.py)

    @property
    def size(self) -> int:
        return group_size(self.group)

    def split_region(self):
        """RNG context for randomness on TP-split activations (a per-TP-rank stream). Entered
        only where dropout draws; at tp > 1 it needs the tracker, or every TP rank would draw
        the same mask for different activations."""
        if self.size == 1:
            return contextlib.nullcontext()
        if self.rng is None:
            raise ValueError(f"dropout at tp={self.size} needs TPContext.rng (an RNGTracker, e.g. "
                             "RNGTracker.for_rank): without one every TP rank would draw the same mask")
        return self.rng.fork("tp")

    def residual_region(self):
        """RNG context for the residual stream: split under sequence parallelism, else shared."""
        return self.split_region() if self.sequence_parallel else contextlib.nullcontext()


def build_norm(cfg: ModelConfig, tp: TPContext, device=None) -> nn.Module:
    if cfg.family == "gpt2":
        norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, device=device)
    else:
        norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, device=device, fused=tp.fused_elementwise)
    if tp.sequence_parallel:
        for p in norm.parameters():
            mark_sequence_parallel(p)
    return norm


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state), run as one compiled function on CUDA when
    ``fused`` (models/fused.py)."""

    def __init__(self, hidden: int, *, eps: float, device=None, fused: bool = False):
        super().__init__(hidden, eps=eps, device=device)
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        return kernels(self.fused, x).rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE tables (cos, sin) of shape [seq, head_dim], rotate-half convention (as Llama / HF)."""

    def __init__(self, head_dim: int, max_seq: int, theta: float, device=None, fused: bool = False):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of channels: head_dim {head_dim} is odd")
        self.fused = fused
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """q, k: [b, heads, s, head_dim] (their own head counts); position_ids [b, s] (packed
        sequences) or None for 0..s-1. Both rotated, in one compiled function when fused."""
        s = q.shape[-2]
        if s > self.cos.shape[0]:
            raise ValueError(f"a sequence of {s} tokens is longer than the RoPE table of model.seq_len = "
                             f"{self.cos.shape[0]} positions")
        if position_ids is None:
            cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        else:  # [b, 1, s, head_dim]
            cos, sin = self.cos[position_ids].unsqueeze(1).to(q.dtype), self.sin[position_ids].unsqueeze(1).to(q.dtype)
        return kernels(self.fused, q).rope(q, k, cos, sin)


class Attention(nn.Module):
    """Causal self-attention; heads are split over TP (each rank owns heads/tp and kv_heads/tp)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, device=None):
        super().__init__()
        self.tp, self.dropout = tp, cfg.dropout
        self.head_dim = cfg.head_dim
        # Whole heads per rank: q/k/v widths may divide by tp while the head counts do not (the
        # split of the fused QKV output would then fail with an unrelated size error).
        for what, n in (("heads", cfg.heads), ("kv_heads", cfg.num_kv_heads)):
            if n % tp.size:
                raise ValueError(f"model.{what} = {n} is not divisible by the TP size {tp.size}: "
                                 "each TP rank needs whole attention heads")
        self.heads, self.kv_heads = cfg.heads // tp.size, cfg.num_kv_heads // tp.size
        bias = cfg.family == "gpt2"
        q, kv = cfg.heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden, [q, kv, kv], tp_group=tp.group, bias=bias,
                                        sequence_parallel=tp.sequence_parallel, init_std=cfg.init_std,
                                        comm_overlap=tp.comm_overlap, fp8=tp.fp8, fp8_cache=tp.fp8_cache,
                                        device=device)
        self.proj = RowParallelLinear(q, cfg.hidden, tp_group=tp.group, bias=bias,
                                      sequence_parallel=tp.sequence_parallel,
                                      init_std=scaled_init_std(cfg.init_std, cfg.layers),
                                      fp8=tp.fp8, fp8_cache=tp.fp8_cache, device=device)
        self.rope = (RotaryEmbedding(cfg.head_dim, cfg.seq_len, cfg.rope_theta, device, tp.fused_elementwise)
                     if cfg.family == "llama" else None)

    def forward(self, x: Tensor, seq: PackedSequence) -> Tensor:
        qkv = self.qkv(x)  # [s, b, (heads + 2 kv_heads) * head_dim / tp]
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        # [s, b, heads * head_dim] -> [b, heads, s, head_dim]
        q, k, v = (t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        if self.rope is not None:
            q, k = self.rope(q, k, seq.position_ids)
        dropout = self.dropout if self.training else 0.0
        with self.tp.split_region() if dropout else contextlib.nullcontext():
            o = seq.attention(q, k, v, dropout, enable_gqa=self.heads != self.kv_heads)  # causal, within documents
        o = o.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)  # [s, b, h/tp]
        return self.proj(o)


class MLP(nn.Module):
    """gpt2: fc2(gelu(fc1 x)); llama: down(silu(gate x) * up x). fc1 / gate_up column-parallel,
    fc2 / down row-parallel: one reduction per MLP."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, device=None):
        super().__init__()
        self.family, self.fused = cfg.family, tp.fused_elementwise
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        ffn, out_std = cfg.ffn_size, scaled_init_std(cfg.init_std, cfg.layers)
        common = dict(tp_group=tp.group, sequence_parallel=tp.sequence_parallel, fp8=tp.fp8, fp8_cache=tp.fp8_cache,
                      device=device)
        gpt2 = cfg.family == "gpt2"  # fc1 holds gate and up side by side for SwiGLU
        self.fc1 = ColumnParallelLinear(cfg.hidden, ffn if gpt2 else [ffn, ffn], bias=gpt2, init_std=cfg.init_std,
                                        comm_overlap=tp.comm_overlap, **common)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden, bias=gpt2, init_std=out_std, **common)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc1(x)
        if self.family == "gpt2":
            y = F.gelu(y, approximate=self.approximate)
        else:
            y = kernels(self.fused, y).swiglu(y)
        return self.fc2(y)


class TransformerLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, device=None):
        super().__init__()
        self.tp, self.dropout = tp, cfg.dropout
        self.attn_norm = build_norm(cfg, tp, device)
        self.attn = Attention(cfg, tp, device)
        self.mlp_norm = build_norm(cfg, tp, device)
        self.mlp = MLP(cfg, tp, device)
        self.graph = None  # a CUDA-graphed replay of block() (use_graph)

    def use_graph(self, replay) -> None:
        """In training, run ``replay(x, seq)`` (this layer's forward and backward captured as CUDA
        graphs: training/cuda_graphs.py) instead of :meth:`block`; None: the block again."""
        self.graph = replay

    def _drop(self, x: Tensor) -> Tensor:
        if not (self.training and self.dropout):
            return x
        with self.tp.residual_region():
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: Tensor, seq: PackedSequence | None = None) -> Tensor:
        if self.graph is not None and self.training:
            return self.graph(x, seq)
        return self.block(x, seq)

    def block(self, x: Tensor, seq: PackedSequence | None = None) -> Tensor:
        x = x + self._drop(self.attn(self.attn_norm(x), seq or PackedSequence()))
        return x + self._drop(self.mlp(self.mlp_norm(x)))
