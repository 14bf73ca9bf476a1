"""Shared by the parity tests: map tensor-parallel shards back to full tensors, and compare
with a tolerance scaled to the tensor (fp32 rounding grows with the values)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def compare_to_full(kind: str, sizes: list[int] | None, shards: list[torch.Tensor], expected: torch.Tensor,
                    where: str, vocab: int, check=assert_close) -> None:
    """Check TP shards against the full reference tensor: each replica of a replicated tensor,
    or the gathered shards, whose padded vocabulary rows (from ``vocab`` on) must be zero."""
    if kind == "rep":
        for r, s in enumerate(shards):
            check(s, expected, f"{where} (replicated) on TP rank {r}")
        return
    full = unshard(kind, sizes, shards)
    if kind == "vocab":
        assert full.shape[0] % len(shards) == 0 and full.shape[0] >= vocab, f"{where}: padded rows {full.shape[0]}"
        assert torch.count_nonzero(full[vocab:]) == 0, f"{where}: padding rows are not zero"
        full, expected = full[:vocab], expected[:vocab]
    assert full.shape == expected.shape, f"{where}: gathered {tuple(full.shape)} vs {tuple(expected.shape)}"
    check(full, expected, f"{where} ({kind})")


def shared_result(store: dict, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per ``key`` for the tests that share it (one multi-rank call each); a
    failure is remembered and raised again, so that a hang costs one deadline, not one per test."""
    if key not in store:
        try:
            store[key] = compute()
        except Exception as e:
            store[key] = e
    if isinstance(store[key], BaseException):
        raise store[key]
    return store[key]
