"""Choosing the next token from the logits: greedy, or drawn at a temperature from the top-k /
top-p (nucleus) tokens, as transformers' generate does (temperature, then top-k, then top-p).

Every TP rank of the last pipeline stage holds the same gathered logits and a generator seeded
alike, so they draw the same tokens without communicating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0: greedy (the most likely token); else the logits are divided by it before drawing."""
    top_k: int = 0
    """Draw among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Draw among the fewest most likely tokens whose probability reaches top_p (1: all)."""
    seed: int = 0
    """Seed of the draws (the same seed and batch give the same tokens)."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)) or self.top_k < 0 \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature >= 0 (0: greedy), top_k >= 0 (0: no cut) and "
                             f"0 < top_p <= 1, got {self.temperature}, {self.top_k}, {self.top_p}")


def next_tokens(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """logits [b, vocab] -> one token id per row [b] (int64), on the logits' device."""
    logits = logits.float()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # drop a token once the more likely ones already reach top_p (the most likely always stays)
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


__all__ = ["Sampling", "next_tokens"]
