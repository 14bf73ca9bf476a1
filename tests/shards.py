"""Shared by the parity tests: map tensor-parallel shards back to full tensors, and compare
with a tolerance scaled to the tensor (fp32 rounding grows with the values)."""

from __future__ import annotations

import torch

from tessera.models import GPTModel
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

RTOL, ATOL, ATOL_REL = 1e-5, 1e-6, 1e-5


def param_kind(model: GPTModel, name: str) -> tuple[str, list[int] | None]:
    """('col', output_sizes) | ('row', None) | ('vocab', None) | ('rep', None) for a parameter."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    if isinstance(module, VocabParallelEmbedding) or name == "output.weight":
        return "vocab", None
    if isinstance(module, ColumnParallelLinear):
        return "col", module.output_sizes
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        return "row", None
    return "rep", None


def unshard(kind: str, sizes: list[int] | None, shards: list[torch.Tensor]) -> torch.Tensor:
    tp = len(shards)
    if kind == "col":
        local = [n // tp for n in sizes]
        parts = [s.split(local, dim=0) for s in shards]
        return torch.cat([torch.cat([parts[r][j] for r in range(tp)], dim=0) for j in range(len(sizes))], dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "vocab":
        return torch.cat(shards, dim=0)
    raise ValueError(kind)


def assert_close(actual, expected, what):
    atol = max(ATOL, ATOL_REL * expected.detach().abs().max().item()) if expected.numel() else ATOL
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")
