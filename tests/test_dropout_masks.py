"""Dropout masks across TP ranks: independent where the ranks hold different activations,
identical where they hold the same ones.

Under sequence parallelism each TP rank holds its own slice of the residual stream, so its
residual dropout (after the embedding, after attention, after the MLP) must draw from its own
stream (``TPContext.residual_region``, the tracker's ``tp`` stream): drawn from the stream all TP
ranks share, every rank would apply the same mask to different positions, a correlation that no
loss comparison sees (each layout drops as many units, only not independently). Attention
dropout acts on each rank's own heads, so its masks differ at every setting. Without sequence
parallelism the residual stream is replicated over TP, and its masks must be identical, or the
replicas drift apart.

The masks are read as dropout draws them: a dispatch mode records every Bernoulli sample of a
tp=2 model's forward, on two gloo ranks. With p = 0.5, two independent masks agree at half of
their positions (1 - 2p(1-p)); the same mask at all of them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training_runs import shared_result
from tessera.config import load_config
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.build import build_chunks
from tessera.training.plan import make_plan

P, SEQ, BATCH, HIDDEN, HEADS, LAYERS = 0.5, 16, 2, 32, 4, 2
_results: dict = {}


class DropoutMasks(TorchDispatchMode):
    """Records the keep-masks that dropout draws (``bernoulli_`` on a CPU, ``native_dropout``
    where torch fuses it), in the order they are drawn."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("bernoulli_", "bernoulli"):
            self.masks.append(out.detach().bool().clone())
        elif name == "native_dropout":
            self.masks.append(out[1].detach().clone())
        return out


def _masks_worker(rank: int, world: int) -> dict[bool, dict]:
    topo = Topology.build(tp=2)
    return {sp: _forward_masks(topo, sp) for sp in (False, True)}


def _forward_masks(topo: Topology, sequence_parallel: bool) -> dict:
    """The dropout masks of one training-mode forward of a tp=2 model on this rank."""
    cfg = load_config(None, [f"model.hidden={HIDDEN}", f"model.heads={HEADS}", f"model.layers={LAYERS}",
                             f"model.seq_len={SEQ}", "model.vocab_size=64", f"model.dropout={P}",
                             "parallel.tp=2", "parallel.dp=1",
                             f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
                             f"train.micro_batch={BATCH}", f"train.global_batch={BATCH}", "train.seed=3"])
    plan = make_plan(cfg, topo.device)
    (model,) = build_chunks(cfg, topo, plan, RNGTracker.for_rank(cfg.train.seed, topo.tp_rank))
    model.train()
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))  # the same on both ranks
    recorder = DropoutMasks()
    with recorder:
        model(tokens=tokens)
    local_seq = SEQ // 2 if sequence_parallel else SEQ
    residual = [m for m in recorder.masks if m.shape == (local_seq, BATCH, HIDDEN)]
    attention = [m for m in recorder.masks if m.shape == (BATCH, HEADS // 2, SEQ, SEQ)]
    # after the embedding, then after attention and after the MLP of every layer; one per layer in attention
    assert len(residual) == 1 + 2 * LAYERS and len(attention) == LAYERS, \
        f"unexpected dropout draws: {[tuple(m.shape) for m in recorder.masks]}"
    return dict(residual=residual, attention=attention)


def _masks(sequence_parallel: bool) -> list[dict]:
    """Each TP rank's masks, with or without sequence parallelism (one run_ranks for both)."""
    by_rank = shared_result(_results, "tp2", lambda: run_ranks(_masks_worker, 2, timeout=60))
    return [out[sequence_parallel] for out in by_rank]


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of positions where two masks agree."""
    return (a == b).float().mean().item()


def _assert_independent(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    independent = 1 - 2 * P * (1 - P)
    for rank, m in enumerate((a, b)):
        assert abs(m.float().mean().item() - (1 - P)) < 0.1, f"{what}: rank {rank} keeps {m.float().mean():.2f}"
    agree = _agreement(a, b)
    assert abs(agree - independent) < 0.1, (f"{what}: the TP ranks' masks agree at {agree:.1%} of the positions "
                                            f"(independent masks: {independent:.0%}, the same mask: 100%)")


@pytest.mark.timeout(90)
def test_residual_dropout_is_independent_across_tp_ranks_under_sequence_parallelism():
    r0, r1 = _masks(True)
    for i, (a, b) in enumerate(zip(r0["residual"], r1["residual"])):
        _assert_independent(a, b, f"sequence parallel, residual dropout {i} (sequence slices)")


@pytest.mark.timeout(90)
def test_residual_dropout_is_identical_across_tp_ranks_without_sequence_parallelism():
    r0, r1 = _masks(False)
    for i, (a, b) in enumerate(zip(r0["residual"], r1["residual"])):
        assert torch.equal(a, b), (f"residual dropout {i}: the replicated stream got masks that agree at only "
                                   f"{_agreement(a, b):.1%} of the positions on the two TP ranks")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_attention_dropout_is_independent_across_tp_ranks(sequence_parallel):
    r0, r1 = _masks(sequence_parallel)
    for i, (a, b) in enumerate(zip(r0["attention"], r1["attention"])):
        _assert_independent(a, b, f"attention dropout of layer {i} (each rank's heads)")
