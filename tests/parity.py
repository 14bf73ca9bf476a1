"""Comparing a parallel run with the one-process reference (the parity tests' shared checks).

- Tensors: a tensor-parallel shard maps back to its slice of the full tensor (``param_kind``,
  ``unshard``, ``compare_to_full``), compared with a tolerance scaled to the tensor
  (``assert_close``: fp32 rounding grows with the values) or the looser ``tp_close`` where TP
  splits every matmul's sum.
- Training curves: every step's loss *and gradient norm* within the same relative tolerance
  (``assert_same_training`` for ``training_runs.train_run``'s results, ``assert_same_curve`` for
  logged metrics). The norm is checked beside the loss because under Adam a wrong gradient shows
  in the norm first: Adam's update is normalised, so the loss moves only a step or more later.

Rank processes import the test modules that import this one: it imports no pytest at module
level (about 0.1 s of CPU per rank).
"""

from __future__ import annotations

import math

import torch

from tessera.checkpoint import dcp, store
from tessera.config import ModelConfig
from tessera.models import GPTModel
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

RTOL, ATOL, ATOL_REL = 1e-5, 1e-6, 1e-5


# -- tensors ---------------------------------------------------------------------------------------------
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


def tp_close(actual, expected, what):
    """tp=2 splits every matmul's sum differently; after 5 Adam steps of the tiny model that is
    ~1e-6 (Adam moves the weights whose gradient is rounding noise by up to lr)."""
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


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


# -- training curves -------------------------------------------------------------------------------------
def _close(got: float, want: float, rel: float) -> bool:
    """pytest.approx(want, rel=rel) == got, without pytest: NaN matches nothing."""
    return abs(got - want) <= max(rel * abs(want), 1e-12) if math.isfinite(want) else got == want


def assert_same_step(what: str, step: int, loss: tuple[float, float], norm: tuple[float, float], rel: float) -> None:
    """One step's (reference, run) loss and gradient norm, within the same ``rel``."""
    assert _close(loss[1], loss[0], rel), f"{what}: loss at step {step}: {loss[1]} vs {loss[0]} (rel {rel})"
    assert _close(norm[1], norm[0], rel), f"{what}: grad norm at step {step}: {norm[1]} vs {norm[0]} (rel {rel})"


def assert_same_training(run: dict, ref: dict, what: str, rel: float = 1e-5) -> None:
    """``training_runs.train_run`` results: every step's loss and gradient norm."""
    assert len(run["losses"]) == len(ref["losses"]) and len(run["norms"]) == len(ref["norms"]), what
    for step, (a, b, m, n) in enumerate(zip(ref["losses"], run["losses"], ref["norms"], run["norms"]), 1):
        assert_same_step(what, step, (a, b), (m, n), rel)


def assert_same_params(got: dict[str, torch.Tensor], ref: dict, what: str, check=None) -> None:
    assert set(got) == set(ref["params"]), what
    for name, p in got.items():
        (check or assert_close)(p, ref["params"][name], f"{what}: {name}")


def assert_same_curve(reference: list[dict], run: list[dict], rel: float = 1e-4, what: str = "") -> None:
    """Logged metrics (metrics.jsonl, the trainer's history): the same steps, learning rates and
    token counts, every step's loss and gradient norm within ``rel``."""
    assert [m["step"] for m in run] == [m["step"] for m in reference], what
    for a, b in zip(reference, run):
        assert_same_step(what, a["step"], (a["loss"], b["loss"]), (a["grad_norm"], b["grad_norm"]), rel)
        assert b["lr"] == a["lr"] and b["tokens"] == a["tokens"], (what, a["step"])


def tessera_model(path: str) -> GPTModel:
    """A one-process GPTModel holding the checkpoint's weights (the vocabulary's padding rows zero)."""
    cfg = ModelConfig(**store.read_meta(path)["config"]["model"])
    model = GPTModel(cfg)
    whole = dcp.read_whole(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_()
            p[: whole["model." + name].shape[0]].copy_(whole["model." + name])
    return model.eval()
