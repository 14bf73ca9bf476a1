"""The zigzag layout of a sequence over the cp ranks: 2 * cp chunks of ``c = s / (2 * cp)`` tokens,
cp rank r holding chunks r and 2 * cp - 1 - r side by side, so that under the causal mask every
rank has the same amount of attention to compute (a late chunk pays for an early one)."""

from __future__ import annotations

import torch
from torch import Tensor


def _check(s: int, cp: int, cp_rank: int) -> None:
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} is not in [0, {cp})")
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2 * cp = {2 * cp}: the zigzag layout "
                         "needs two equal chunks per cp rank")


def zigzag(x: Tensor, cp_rank: int, cp: int, dim: int) -> Tensor:
    """This rank's two chunks of the full sequence along ``dim``, concatenated."""
    _check(x.shape[dim], cp, cp_rank)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim)


def positions(s: int, cp_rank: int, cp: int, device=None) -> Tensor:
    """The sample positions (0 .. s-1) of this rank's local tokens, in local order."""
    return zigzag(torch.arange(s, device=device), cp_rank, cp, dim=0)


def unzigzag(parts: list[Tensor], dim: int) -> Tensor:
    """The full sequence from every rank's local part (rank order): the inverse of :func:`zigzag`."""
    cp = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    if any(p.shape[dim] % 2 for p in parts):
        raise ValueError("every local part holds two equal chunks: its length along dim must be even")
    chunks = [halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(chunks, dim=dim)
