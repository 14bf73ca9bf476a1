"""The KV cache: every layer's keys and values of the tokens seen so far, so that generation runs
the prompts once (prefill) and then one new token per sequence per step (decode).

    cache = KVCache.for_chunks(chunks, batch=b, capacity=n)     # this rank's layers, preallocated
    logits = model(tokens [b, P], cache=cache.prefill(pads))     # the prompts, left-padded to P
    logits = model(tokens [1, b], cache=cache.decode())          # one new token per sequence
    cache.slot += 1                                               # (a device tensor: no host sync)

**Slots.** Slot j of the cache holds the j-th token of the left-padded batch: a prompt of L
tokens padded to P sits in slots P-L .. P-1, and every sequence's next token goes to the same
slot, so a decode step writes one column of each layer's cache with static shapes (a CUDA graph
can replay it). ``valid`` says which slots hold a token, not padding; positions (RoPE, GPT-2's
learned positions) count from each sequence's first token: slot - pad.

**Heads.** Each layer's cache is ``[b, kv_heads / tp, capacity, head_dim]``: grouped-query
attention keeps only the K/V heads, and each TP rank its own.

**A decode step's layout.** Its b new tokens, one per sequence, travel as one sequence of b
tokens (``tokens [1, b]``, activations ``[b, 1, h]``, sequence first): every layer but attention
works token by token and cannot tell, and sequence parallelism splits the b tokens over TP as it
splits any sequence (b a multiple of tp). Attention, the one layer that mixes tokens, turns them
back into b sequences of one query each, attending to their own cache.

Models receive a step (:class:`Prefill`, :class:`Decode`) as ``GPTModel.forward(cache=...)``,
and each layer its view of it (:meth:`layer`), which has what ``PackedSequence`` has: the
positions and ``attention(q, k, v, ...)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCache:
    """This rank's keys and values for the layers it holds (global layer indices): each layer's
    whole capacity allocated at the prefill, in the dtype the layer computes in (under FSDP's
    mixed precision not the parameters'), so decode steps allocate nothing."""

    def __init__(self, layers: Iterable[int], batch: int, kv_heads: int, head_dim: int, capacity: int, *,
                 device: torch.device | str):
        self.layers, self.shape = list(layers), (batch, kv_heads, capacity, head_dim)
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # a token, not padding
        self.pads = torch.zeros(batch, dtype=torch.long, device=device)  # each sequence's left padding
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # where the next decode step writes
        self.batch, self.capacity, self.device = batch, capacity, torch.device(device)

    @classmethod
    def for_chunks(cls, chunks, batch: int, capacity: int) -> "KVCache":
        """A cache for every layer of this rank's model chunks, on their device."""
        cfg, tp = chunks[0].cfg, chunks[0].tp.size
        layers = [int(i) for chunk in chunks for i in chunk.layers]
        return cls(layers, batch, cfg.num_kv_heads // tp, cfg.head_dim, capacity,
                   device=next(chunks[0].parameters()).device)

    def layer_cache(self, index: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``index``'s keys and values ``[b, kv_heads, capacity, head_dim]`` (allocated at
        its first write, in the dtype of ``like``, its new keys)."""
        if index not in self.keys:
            if index not in self.layers:
                raise KeyError(f"layer {index} is not one of this cache's layers {self.layers}")
            self.keys[index] = torch.zeros(self.shape, dtype=like.dtype, device=like.device)
            self.values[index] = torch.zeros_like(self.keys[index])
        return self.keys[index], self.values[index]

    def prefill(self, pads: list[int], length: int) -> "Prefill":
        """A forward of ``[b, length]`` left-padded tokens (``pads[i]`` padding tokens first in
        row i) into slots ``0 .. length-1``; whatever the cache held is forgotten. The next
        decode step writes slot ``length``."""
        if len(pads) != self.batch or not 0 < length <= self.capacity or max(pads) >= length:
            raise ValueError(f"a prefill of {len(pads)} sequences of {length} slots with pads {pads[:8]} does not "
                             f"fit a cache of {self.batch} sequences and {self.capacity} slots")
        self.pads.copy_(torch.tensor(pads, dtype=torch.long))
        slots = torch.arange(length, device=self.device)
        self.valid.zero_()
        self.valid[:, :length] = slots >= self.pads[:, None]
        self.slot.fill_(length)
        return Prefill(self, length, padded=max(pads) > 0)

    def decode(self, end: int | None = None) -> "Decode":
        """A forward of one new token per sequence (``tokens [1, b]``), written at ``slot``.
        ``end``: attend to slots ``[0, end)`` (slot + 1 at least); None: the whole capacity, a
        static shape (what a CUDA graph replays)."""
        return Decode(self, self.capacity if end is None else end)


class _LayerView:
    """What one layer's attention reads from a step: positions, and attention through the cache."""

    def __init__(self, step: "Prefill | Decode", index: int):
        self.step, self.index = step, index

    @property
    def position_ids(self) -> Tensor:
        return self.step.position_ids

    def attention(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, enable_gqa: bool) -> Tensor:
        if dropout_p:
            raise ValueError("attention with a KV cache runs in eval mode (no dropout)")
        return self.step.attention(self.index, q, k, v, enable_gqa)


class Prefill:
    """The prompts' forward: each layer writes its keys and values into slots ``0 .. P-1`` and
    attends causally among the tokens (padding never attended to)."""

    last_only = True  # only the last position's logits are sampled from (GPTModel.forward)

    def __init__(self, cache: KVCache, length: int, padded: bool):
        self.cache, self.length = cache, length
        slots = torch.arange(length, device=cache.device)
        self.position_ids = (slots - cache.pads[:, None]).clamp_min(0)  # [b, P]
        self.mask = None  # no padding: plain causal attention (flash kernels take it)
        if padded:  # [b, 1, P, P]: causal, valid keys; each padding query sees itself (no empty row: no NaN)
            causal = torch.ones(length, length, dtype=torch.bool, device=cache.device).tril()
            self.mask = ((causal & cache.valid[:, None, :length]) | torch.eye(length, dtype=torch.bool,
                                                                              device=cache.device)).unsqueeze(1)

    def layer(self, index: int) -> _LayerView:
        return _LayerView(self, index)

    def attention(self, index: int, q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> Tensor:
        """q, k, v: [b, heads, P, head_dim] (their own head counts)."""
        keys, values = self.cache.layer_cache(index, k)
        keys[:, :, : self.length] = k
        values[:, :, : self.length] = v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None,
                                              enable_gqa=enable_gqa)


class Decode:
    """One new token per sequence: each layer writes its key and value at ``slot`` and each
    sequence's query attends to its valid slots ``[0, end)``."""

    last_only = False

    def __init__(self, cache: KVCache, end: int):
        self.cache, self.end = cache, end
        cache.valid.index_fill_(1, cache.slot, True)
        self.position_ids = (cache.slot - cache.pads).clamp_min(0).view(1, -1)  # [1, b]: b tokens in a row
        self.mask = cache.valid[:, None, None, :end]  # [b, 1, 1, end]

    def layer(self, index: int) -> _LayerView:
        return _LayerView(self, index)

    def attention(self, index: int, q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> Tensor:
        """q, k, v: [1, heads, b, head_dim], the b new tokens along the sequence -> [1, heads, b, head_dim]."""
        q, k, v = (t.transpose(0, 2) for t in (q, k, v))  # [b, heads, 1, head_dim]
        keys, values = self.cache.layer_cache(index, k)
        keys.index_copy_(2, self.cache.slot, k)
        values.index_copy_(2, self.cache.slot, v)
        b, heads, _, d = q.shape
        kv_heads = keys.shape[1]
        # The query heads sharing one K/V head (GQA) attend as that head's queries: [b, kv, heads/kv, d]
        # against [b, kv, end, d], so the cache is read once, not once per query head.
        o = F.scaled_dot_product_attention(q.reshape(b, kv_heads, heads // kv_heads, d), keys[:, :, : self.end],
                                           values[:, :, : self.end], attn_mask=self.mask)
        return o.reshape(b, heads, 1, d).transpose(0, 2)


__all__ = ["KVCache", "Prefill", "Decode"]
