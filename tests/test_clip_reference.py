"""Gradient clipping against torch.nn.utils.clip_grad_norm_, on both sides of the limit.

Every layout shares ``clip_coefficient``, so the parity tests (each layout against tessera's own
one-process run) cannot see a mistake in it: without its min(1, .) every step would scale its
gradients up to the limit, and Adam, nearly blind to a gradient's scale, would hide most of it.
Here torch's clip_grad_norm_ on the same gradients is the reference: below the limit the
gradients are scaled by clip / norm, above it they are left as they are, bit for bit, and a
short training run with a limit far above the norm is the run without clipping, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.config import load_config
from tessera.optim import clip_coefficient, global_grad_norm
from tessera.topology import Topology
from tessera.training.build import build, build_topology
from tessera.training.step import train_step

SHAPES = [(24, 16), (16,), (16, 48), (48,), (5, 7, 3), (1,)]


def _grads(seed: int = 0) -> list[tuple[torch.Tensor, nn.Parameter]]:
    """(gradient, parameter) pairs of mixed shapes and scales, as the optimizers hand them over."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * scale, nn.Parameter(torch.zeros(shape)))
            for shape, scale in zip(SHAPES, (0.3, 2.0, 0.05, 1.0, 0.7, 4.0))]


def _torch_clipped(grads, max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's total norm and the gradients clip_grad_norm_ leaves, on copies."""
    params = []
    for grad, _ in grads:
        p = nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


def _clipped(grads, max_norm: float) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """tessera's norm, factor and the gradients times the factor (as the optimizers apply it)."""
    norm = global_grad_norm(grads, Topology.build())
    coef = clip_coefficient(norm, max_norm)
    return norm, coef, [g if coef is None else g * coef for g, _ in grads]


def test_global_norm_equals_torch_total_norm():
    grads = _grads()
    norm = global_grad_norm(grads, Topology.build())
    expected = torch.nn.utils.get_total_norm([g for g, _ in grads])
    # the squares are summed in another order than torch's: a few ulps apart at most
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert norm.dtype == torch.float32 and norm.ndim == 0


@pytest.mark.parametrize("fraction", [0.5, 0.1, 1e-3])
def test_below_the_limit_gradients_are_scaled_by_clip_over_norm(fraction):
    grads = _grads()
    max_norm = fraction * torch.nn.utils.get_total_norm([g for g, _ in grads]).item()
    torch_norm, expected = _torch_clipped(grads, max_norm)
    # given torch's norm, tessera's factor gives torch's clipped gradients bit for bit
    coef = clip_coefficient(torch_norm, max_norm)
    for (grad, _), ref in zip(grads, expected):
        assert torch.equal(grad * coef, ref)
    # with its own norm (an ulp or two from torch's), to that precision
    _, coef, clipped = _clipped(grads, max_norm)
    assert coef.item() == pytest.approx(fraction, rel=1e-5)
    for mine, ref in zip(clipped, expected):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0)
    assert torch.nn.utils.get_total_norm(clipped).item() == pytest.approx(max_norm, rel=1e-5)


@pytest.mark.parametrize("above", [1.001, 2.0, 1e6])
def test_above_the_limit_gradients_are_left_bit_for_bit(above):
    grads = _grads(1)
    norm = torch.nn.utils.get_total_norm([g for g, _ in grads]).item()
    _, expected = _torch_clipped(grads, above * norm)
    _, coef, clipped = _clipped(grads, above * norm)
    assert coef.item() == 1.0, f"a limit {above} x the norm must not scale the gradients (factor {coef.item()})"
    for (original, _), mine, ref in zip(grads, clipped, expected):
        assert torch.equal(mine, original) and torch.equal(ref, original)


def test_exactly_at_the_limit_the_norm_stays_at_the_limit():
    """Norm == limit: the factor is limit / (norm + 1e-6), as torch's, within an ulp or two
    below 1 (the 1e-6 guards a zero norm); the clipped norm is the limit."""
    grads = _grads(2)
    limit = torch.nn.utils.get_total_norm([g for g, _ in grads]).item()
    torch_norm, expected = _torch_clipped(grads, limit)
    coef = clip_coefficient(torch_norm, limit)
    assert 1.0 - 1e-6 < coef.item() <= 1.0
    for (grad, _), ref in zip(grads, expected):
        assert torch.equal(grad * coef, ref)
    _, coef, clipped = _clipped(grads, limit)  # tessera's own norm: the same to an ulp
    assert 1.0 - 1e-6 < coef.item() <= 1.0
    assert torch.nn.utils.get_total_norm(clipped).item() == pytest.approx(limit, rel=1e-6)


def test_zero_disables_clipping_and_a_zero_norm_gives_no_nan():
    assert clip_coefficient(torch.tensor(3.0), 0.0) is None
    assert clip_coefficient(torch.tensor(0.0), 1.0).item() == 1.0  # all-zero gradients: no 0/0


# -- a whole short run: a limit far above the norm is no clipping, bit for bit -----------------

SEQ, VOCAB, STEPS = 8, 40, 4
RUN = ["model.hidden=16", "model.layers=2", "model.heads=2", f"model.seq_len={SEQ}", f"model.vocab_size={VOCAB}",
       "model.vocab_pad_multiple=8", "train.micro_batch=2", "train.global_batch=4", f"train.steps={STEPS}",
       "optim.lr=1e-2", "optim.warmup=0", "optim.weight_decay=0.1", "train.seed=5", "parallel.dp=1"]


def _train(clip_grad: float) -> dict:
    cfg = load_config(None, RUN + [f"optim.clip_grad={clip_grad}"])
    parts = build(cfg, build_topology(cfg, torch.device("cpu")))
    losses, norms = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        rows = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": torch.ones(4, SEQ)}
        mbs = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
        r = train_step(parts.optimizer, mbs, parts.topo, parts.executor(2), parts.data_parallel, clip_grad=clip_grad)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return dict(losses=losses, norms=norms, params={n: p.detach().clone() for n, p in parts.model.named_parameters()})


def test_training_with_a_limit_far_above_the_norm_is_training_without_clipping():
    off, far = _train(0.0), _train(1e6)
    assert max(off["norms"]) < 1e3
    assert far["losses"] == off["losses"] and far["norms"] == off["norms"]
    for name, p in off["params"].items():
        assert torch.equal(far["params"][name], p), f"{name}: clip_grad=1e6 changed the run"
    # and clipping that binds does change it (the factor reaches the optimizer)
    tight = _train(0.5 * min(off["norms"]))
    assert tight["losses"][0] == off["losses"][0] and tight["losses"][1:] != off["losses"][1:]
