"""What a forward keeps for its backward: predicted per layer (:class:`Activations`) and measured
(:func:`kept_bytes`).

**Predicted** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", adapted to tessera's kernels): every tensor a layer's backward needs, in bytes, per
micro-batch, named by what it is. With T = micro_batch * seq_len / cp tokens on this rank, t = tp,
B the dtype's bytes, a residual-stream tensor is T*h*B (T*h*B/t under sequence parallelism) and a
column-parallel layer's input T*h*B (tessera keeps it gathered, where Megatron gathers it again in
the backward). Where tessera differs from the paper's 34*s*b*h + 5*a*s^2*b per layer:

- no s x s term: SDPA's flash / memory-efficient kernels (and the CPU's flash kernel) keep q, k, v,
  the output and a log-sum-exp (fp32) only; attention dropout draws inside the kernel (no mask);
- GQA (k and v have kv_heads), SwiGLU (gate, up, silu(gate), the product) and RoPE (rotated q, k);
- dropout masks only where model.dropout > 0 (1 byte each, CUDA's bool mask);
- RMSNorm keeps its normalised input too where it runs decomposed (a CPU), not with CUDA's fused
  kernel or the compiled function (``fused_elementwise``), which also keeps no silu(gate).

``train.recompute=selective`` keeps the layer's input and the GEMMs' and attention's outputs (the
row-parallel GEMMs' before their reduction: the whole local sequence even under SP); ``full`` the
input only. The trainer's pipelines multiply these by the micro-batches each rank holds
(training/memory_model.py).

Every storage an op allocates while ``fn()`` runs is watched through a weak reference
(a ``TorchDispatchMode`` sees every op, inside autograd functions and recomputed regions too);
those still alive once ``fn`` has returned are what the forward left for the backward: tensors
autograd saved, a recomputed region's inputs, the outputs selective recomputation keeps, and
whatever ``fn`` returns. Views and in-place results share their input's storage and are not
counted again; parameters and inputs allocated before ``fn`` are not counted at all. Unlike
``saved_tensors_hooks``, which a checkpointed region replaces with its own, this sees every mode
of ``train.recompute`` alike.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tessera.config import ModelConfig
from tessera.tensor_parallel.layers import padded_vocab_size

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class _NewStorages(TorchDispatchMode):
    """Weak references to the storages the ops allocate (by address; an address freed and reused
    takes the newer storage); ``track_peak``: also the most bytes of them alive after any op."""

    def __init__(self, track_peak: bool = False):
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, int]] = {}
        self.track_peak, self.peak = track_peak, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = _storages((args, kwargs))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            address, old = storage.data_ptr(), self.refs.get(storage.data_ptr())
            if address not in given and storage.nbytes() and (old is None or old[0]() is None):
                self.refs[address] = (weakref.ref(storage), storage.nbytes())
        if self.track_peak:  # (after the op: its output and its inputs alive together)
            self.peak = max(self.peak, sum(nbytes for ref, nbytes in self.refs.values() if ref() is not None))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.refs.values() if ref() is not None)


def kept_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the storages allocated while ``fn()`` runs that are still alive after it (keep
    what ``fn`` returns somewhere of yours, and subtract it, to count only what autograd keeps)."""
    mode = _NewStorages()
    with mode:
        fn()
    return mode.alive()


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of storages allocated while ``fn()`` runs (a backward's too, on a CPU) that
    were alive at once, counted after every op: what a transient costs on top of what was held."""
    mode = _NewStorages(track_peak=True)
    with mode:
        fn()
    return mode.peak


@dataclass(frozen=True)
class Activations:
    """The activation bytes of one micro-batch on one rank, by the layout's sizes. ``device``:
    "cuda" (the kernels the model is written for) or "cpu" (decomposed RMSNorm, as the CPU tests
    measure it)."""

    model: ModelConfig
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    dtype: str = "bf16"
    fp8: str = "none"
    fp8_gathered: bool = False  # zero=3 gathers the fp8 weights in fp8: none of their own copies kept
    fused_elementwise: bool = False
    fused_cross_entropy: bool = True
    device: str = "cuda"

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return self.micro_batch * self.model.seq_len // self.cp

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def _residual(self, per_token: float) -> float:
        """A residual-stream-shaped tensor (split over tp under sequence parallelism)."""
        return self.tokens * per_token / (self.tp if self.sequence_parallel else 1)

    def _heads(self, width: int, nbytes: float | None = None) -> float:
        """A tensor of ``width`` features per token split over tp (heads, the MLP's width)."""
        return self.tokens * width * (self.bytes if nbytes is None else nbytes) / self.tp

    # -- one transformer layer ----------------------------------------------------------------------
    def layer(self, recompute: str = "none") -> dict[str, float]:
        """What one layer keeps until its backward, by name (bytes)."""
        m, B = self.model, self.bytes
        h, d, f = m.hidden, m.head_dim, m.ffn_size
        llama = m.family == "llama"
        residual, gathered = self._residual(h * B), self.tokens * h * B
        qkv = self._heads((m.heads + 2 * m.num_kv_heads) * d)
        attention = self._heads(m.heads * d) + self._heads(m.heads, 4)  # output, log-sum-exp (fp32)
        fc1 = self._heads((2 if llama else 1) * f)
        if recompute == "full":
            return {"input": residual}
        if recompute == "selective":
            kept = {"input": residual, "qkv": qkv}
            if self.cp == 1 and not m.dropout:  # (SelectivePolicy: no ring blocks, no random kernels)
                kept["attention"] = attention
            row = self.tokens * h * B  # a row-parallel GEMM's output, before its reduction
            return {**kept, "proj": row, "fc1": fc1, "fc2": row}
        kept_input, norm = self._norm()
        out = {"input": kept_input, "attn_norm": norm, "qkv_input": self._linear_input(gathered), "qkv": qkv}
        if llama:  # the rotated q and k; with cp (positions given) also the cos / sin rows per token
            out["rope"] = self._heads((m.heads + m.num_kv_heads) * d) + (2 * self.tokens * d * B if self.cp > 1 else 0)
        out["attention"] = attention
        if self.cp > 1:  # the ring's output is [b, heads, s, d]: the projection keeps its [s, b, h] copy
            out["proj_input"] = self._heads(m.heads * d)
        elif self.fp8 == "tensorwise":  # the output projection's quantized copy of its input
            out["proj_input"] = self._heads(m.heads * d, 1)
        out["residual_mid"] = kept_input
        out["mlp_norm"] = norm
        out["fc1_input"] = self._linear_input(gathered)
        out["fc1"] = fc1
        if llama and not self.fused_elementwise:
            out["silu"] = self._heads(f)
        out["fc2_input"] = self._heads(f, 1 if self.fp8 == "tensorwise" else None)
        if self.fp8 == "tensorwise" and not self.fp8_gathered:  # fp8 copies of the four weights (1 byte an element)
            out["fp8_weights"] = ((m.heads + 2 * m.num_kv_heads) * d * h + m.heads * d * h
                                  + (2 if llama else 1) * f * h + f * h) / self.tp
        if m.dropout:
            out["dropout_masks"] = 2 * self._residual(h)
        return out

    def _norm(self) -> tuple[float, float]:
        """(the norm's saved input, its own keep besides). LayerNorm: its input, mean and rstd
        (fp32). RMSNorm: its input and rstd (fp32); run decomposed (a CPU, unfused) it keeps an
        fp32 copy of its input and the fp32 normalised input instead."""
        h, B = self.model.hidden, self.bytes
        if self.model.family == "gpt2":
            return self._residual(h * B), 2 * self._residual(4)
        if self.device == "cpu" and not self.fused_elementwise:
            return self._residual(h * 4), self._residual(4) + self._residual(h * 4)
        return self._residual(h * B), self._residual(4)

    def _linear_input(self, gathered: float) -> float:
        """A column-parallel layer's saved input: gathered under SP; fp8 tensorwise keeps it
        quantized (1 byte)."""
        return gathered / self.bytes if self.fp8 == "tensorwise" else gathered

    def layer_total(self, recompute: str = "none") -> float:
        return sum(self.layer(recompute).values())

    # -- outside the layers -------------------------------------------------------------------------
    def embedding(self) -> float:
        """The first stage's embedding: at tp > 1 its masked ids (int64) and mask (bool); under SP
        the rest of the whole-sequence sum the first layer's input is a slice (a view) of; with
        dropout, the embedding dropout's mask."""
        m, out = self.model, 0.0
        if self.tp > 1:
            out += self.tokens * 9
            if self.sequence_parallel:
                out += self.tokens * m.hidden * self.bytes * (1 - 1 / self.tp)
        return out + (self._residual(m.hidden) if m.dropout else 0)

    def head(self) -> float:
        """The last stage: the final norm's input and keep, the output layer's (gathered) input,
        and the loss's keep: an fp32 softmax of the logits (reference) or the 16-bit logits (fused),
        its targets, and the per-token loss (fp32)."""
        m = self.model
        vocab = padded_vocab_size(m.vocab_size, self.tp, m.vocab_pad_multiple) // self.tp
        loss = self.tokens * vocab * (self.bytes if self.fused_cross_entropy else 4)
        targets = self.tokens * 9  # the loss's local target ids (int64) and which are another rank's (bool)
        return sum(self._norm()) + self.tokens * m.hidden * self.bytes + loss + targets + self.tokens * 4

    # -- transients ---------------------------------------------------------------------------------
    def logits_transient(self) -> float:
        """Beside what the head keeps (the fused loss's 16-bit logits, or the reference loss's fp32
        softmax): one logits-sized tensor in the dtype, the logits beside their fp32 copy in the
        reference forward, and the logits' gradient in the backward (the fused kernels keep their
        fp32 work in registers; the reference backward turns the softmax into the gradient in place)."""
        m = self.model
        vocab = padded_vocab_size(m.vocab_size, self.tp, m.vocab_pad_multiple) // self.tp
        return self.tokens * vocab * self.bytes

    def layer_transient(self, recompute: str = "none") -> float:
        """During one layer's backward: what a recomputed layer rebuilds, and the gradients of its
        two widest tensors (assumed: autograd frees each gradient once consumed)."""
        rebuilt = self.layer_total("none") - self.layer_total(recompute)
        m = self.model
        widest = max(self.tokens * m.hidden * self.bytes, self._heads((2 if m.family == "llama" else 1) * m.ffn_size))
        return rebuilt + 2 * widest

    def weight_grads_pending(self) -> float:
        """One layer's deferred weight gradients (zero-bubble: I done, W not): each linear layer's
        input and output gradient."""
        m, B = self.model, self.bytes
        h, d, f = m.hidden, m.head_dim, m.ffn_size
        gathered = self.tokens * h * B
        qkv = self._heads((m.heads + 2 * m.num_kv_heads) * d)
        fc1 = self._heads((2 if m.family == "llama" else 1) * f)
        return (gathered + qkv) + (self._heads(m.heads * d) + gathered) + (gathered + fc1) + (self._heads(f) + gathered)

    def head_weight_grads_pending(self) -> float:
        """The output layer's deferred weight gradient: its input and the logits' gradient."""
        m = self.model
        vocab = padded_vocab_size(m.vocab_size, self.tp, m.vocab_pad_multiple) // self.tp
        return self.tokens * (m.hidden + vocab) * self.bytes


__all__ = ["kept_bytes", "peak_bytes", "Activations", "DTYPE_BYTES"]
