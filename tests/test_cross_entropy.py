"""vocab_parallel_cross_entropy against F.cross_entropy(reduction='none') on the full logits.

Each rank passes its slice of the (padded) vocabulary. Logit columns beyond ``vocab_size`` are
padding: they are given huge values on purpose, and must still get zero probability, zero
gradient and leave the loss unchanged. Ranks record (label, actual, expected) and the test
process compares (see test_mappings.py for why).

Both implementations run every case: the reference ops and the fused formulation (eager here;
compiled on CUDA, where tests/test_gpu.py compares the two).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from tessera.tensor_parallel import padded_vocab_size, vocab_parallel_cross_entropy
from tessera.testing import run_ranks

TIMEOUT = 90
TOL = dict(rtol=1e-5, atol=1e-6)
PAD_VALUE = 1e4  # far above every real logit: if padding leaked into the softmax it would dominate


def verify(results):
    for rank, checks in enumerate(results):
        for label, actual, expected, tol in checks:
            assert_close(actual, expected, **tol, msg=lambda m: f"rank {rank} of {len(results)}: {label}: {m}")
    return [[label for label, *_ in c] for c in results]


def _one_case(rank, tp, group, gen, checks, name, shape, vocab, padded, dtype=torch.float32, tol=TOL, fused=False):
    """One loss computation; ``shape`` is the token shape, logits are [*shape, padded]."""
    def close(label, actual, expected, exact=False):
        assert actual.shape == expected.shape, f"{name}: {label}: {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.dtype == expected.dtype, f"{name}: {label}: {actual.dtype} != {expected.dtype}"
        checks.append((f"{name}: {label}", actual.detach().clone(), expected.detach().clone(),
                       dict(rtol=0.0, atol=0.0) if exact else tol))

    full = torch.randn(*shape, padded, generator=gen) * 3.0
    full[..., vocab:] = PAD_VALUE
    target = torch.randint(vocab, shape, generator=gen).flatten()
    target[:2] = torch.tensor([0, vocab - 1])  # the first and the last real token
    target = target.view(shape)
    weights = torch.rand(*shape, generator=gen)  # the upstream gradient of the per-token loss
    weights.view(-1)[2] = 0.0

    # reference: the real columns only (the padding is not part of the vocabulary)
    ref_logits = full.to(dtype, copy=True).requires_grad_()
    ref_loss = F.cross_entropy(ref_logits[..., :vocab].float().reshape(-1, vocab), target.reshape(-1),
                               reduction="none").view(shape)
    (ref_loss * weights).sum().backward()

    local = full.chunk(tp, dim=-1)[rank].to(dtype, copy=True).requires_grad_()
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, group, vocab, fused=fused)
    close("loss", loss, ref_loss)
    (loss * weights).sum().backward()
    close("logits grad", local.grad, ref_logits.grad.chunk(tp, dim=-1)[rank])
    close("logits left unchanged", local.detach(), before, exact=True)
    # the padding columns of this rank get exactly zero gradient
    start = rank * local.shape[-1]
    pad_from = min(max(vocab - start, 0), local.shape[-1])
    pad_grad = local.grad[..., pad_from:]
    close("padding grad is zero", pad_grad, torch.zeros_like(pad_grad), exact=True)
    if dtype != torch.float32:
        return
    # the gradient of each token's loss sums to zero over the vocabulary (softmax - onehot)
    row_sums = local.grad.float().sum(-1)
    if tp > 1:
        dist.all_reduce(row_sums, group=group)
    close("grad sums to zero over the vocabulary", row_sums, torch.zeros(shape))


def _cross_entropy_rank(rank: int, tp: int, fused: bool) -> list:
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    checks: list = []
    _case = functools.partial(_one_case, fused=fused)
    # vocab divisible by every tp: no padding
    _case(rank, tp, group, gen, checks, "vocab 24", (6, 3), 24, 24)
    # vocab 50 padded for this tp (and a multiple of 8 per rank): the last rank holds padding
    _case(rank, tp, group, gen, checks, "vocab 50 pad 1", (6, 3), 50, padded_vocab_size(50, tp, 1))
    _case(rank, tp, group, gen, checks, "vocab 50 pad 8", (6, 3), 50, padded_vocab_size(50, tp, 8))
    # vocab 5 over 8 columns: at tp=4 the last rank holds only padding and rank 2 holds one of each
    _case(rank, tp, group, gen, checks, "vocab 5 in 8", (4, 2), 5, 8)
    # flat tokens (2-D logits) and a single token
    _case(rank, tp, group, gen, checks, "flat tokens", (10,), 50, padded_vocab_size(50, tp, 8))
    # extreme logits: a softmax without the max subtraction overflows
    _case_large(rank, tp, group, gen, checks, fused)
    # bf16 logits: the loss is fp32 and the gradient comes back in bf16
    _case(rank, tp, group, gen, checks, "bf16", (4, 2), 50, padded_vocab_size(50, tp, 8), dtype=torch.bfloat16,
          tol=dict(rtol=1e-2, atol=1e-3))
    return checks


def _case_large(rank, tp, group, gen, checks, fused):
    """Logits around 1e3 (exp overflows fp32 without the max subtraction)."""
    shape, vocab, padded = (3, 2), 24, 32
    full = torch.randn(*shape, padded, generator=gen) * 50.0 + 1000.0
    full[..., vocab:] = 1e5
    target = torch.randint(vocab, shape, generator=gen)
    ref = F.cross_entropy(full[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction="none").view(shape)
    loss = vocab_parallel_cross_entropy(full.chunk(tp, dim=-1)[rank], target, group, vocab, fused=fused)
    assert torch.isfinite(loss).all(), "loss overflowed on large logits"
    checks.append(("large logits: loss", loss.detach().clone(), ref, TOL))


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # (4 ranks: the whole suite)
def test_vocab_parallel_cross_entropy_matches_full(tp, fused):
    labels = verify(run_ranks(_cross_entropy_rank, tp, fused, timeout=TIMEOUT))
    assert all(lab == labels[0] for lab in labels)
    assert len(labels[0]) == 5 * 5 + 4 + 1, labels[0]


def test_fused_path_saves_no_fp32_copy_of_the_logits():
    """The fused loss keeps the 16-bit logits and per-row statistics for backward; the reference
    keeps an fp32 softmax the size of the logits (twice their bytes in bf16)."""
    logits = torch.randn(64, 2, 512, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(500, (64, 2))

    def saved_bytes(fused: bool) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            vocab_parallel_cross_entropy(logits, target, None, 500, fused=fused)
        return sum(sizes)

    small = 64 * 2 * 8 * 4  # per-row statistics and targets, generously
    assert saved_bytes(True) <= logits.numel() * 2 + small
    assert saved_bytes(False) >= logits.numel() * 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_kernels_equal_eager_and_survive_many_shapes():
    """The fused path's compiled kernels (as on CUDA; here inductor's CPU backend) equal the eager
    functions, and ten token counts in one process never hit the recompile limit."""
    from tessera.tensor_parallel.cross_entropy import _Kernels

    compiled, eager = _Kernels(compiled=True), _Kernels(compiled=False)
    g = torch.Generator().manual_seed(3)
    for n in range(1, 11):
        logits = torch.randn(n, 2, 24, generator=g).to(torch.bfloat16)
        valid = 24 - n % 3  # a changing number of real columns too
        assert_close(compiled.row_max(logits, valid), eager.row_max(logits, valid))
    logits = torch.randn(5, 2, 24, generator=g).to(torch.bfloat16)
    target = torch.randint(0, 20, (5, 2), generator=g)
    outside = target >= 18
    row_max = eager.row_max(logits, 20)
    stats = eager.row_stats(logits, row_max, target, outside, 20)
    assert_close(compiled.row_stats(logits, row_max, target, outside, 20), stats)
    grad_loss = torch.rand(5, 2, generator=g)
    assert_close(compiled.logits_grad(logits, row_max, stats[0], target, outside, grad_loss, 20),
                 eager.logits_grad(logits, row_max, stats[0], target, outside, grad_loss, 20))


def _outside_ids_rank(rank: int, tp: int) -> list:
    group = dist.group.WORLD
    vocab, padded = 50, padded_vocab_size(50, tp, 8)
    full = torch.randn(4, padded, generator=torch.Generator().manual_seed(3)) * 3.0
    target = torch.tensor([vocab, padded - 1, padded + 7, -100])  # padding, padding, past it, negative
    out = []
    for fused in (False, True):
        local = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, group, vocab, fused=fused)
        loss.sum().backward()
        out.append((loss.detach(), local.grad))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_ids_outside_the_vocabulary_are_owned_by_no_rank_on_both_paths(tp):
    """Padding ids behave as ids past the padded vocabulary: finite, the same on both paths, no
    gradient reaching a padding column (before, the reference gave inf and the fused path
    trained the padding row of the output weight)."""
    for rank, ((ref_loss, ref_grad), (fused_loss, fused_grad)) in enumerate(run_ranks(_outside_ids_rank, tp,
                                                                                      timeout=TIMEOUT)):
        assert torch.isfinite(ref_loss).all(), ref_loss
        assert_close(fused_loss, ref_loss, **TOL)
        assert_close(fused_grad, ref_grad, **TOL)
        pad_from = min(max(50 - rank * ref_grad.shape[-1], 0), ref_grad.shape[-1])
        assert (ref_grad[..., pad_from:] == 0).all() and (fused_grad[..., pad_from:] == 0).all()


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_mismatched_target_or_vocabulary_is_refused_naming_it(fused):
    """A target not shaped like the logits' leading dims, or a vocab_size wider than the logit
    columns, raises (before: a mis-sized target failed inside gather, and ids past the columns
    silently got the loss of a target logit of 0)."""
    logits = torch.randn(4, 3, 50)
    with pytest.raises(ValueError, match=r"target shape \(3, 4\) does not match the logits' \(4, 3\)"):
        vocab_parallel_cross_entropy(logits, torch.zeros(3, 4, dtype=torch.long), None, 50, fused=fused)
    with pytest.raises(ValueError, match=r"target shape \(4, 1\) does not match"):  # used to broadcast silently
        vocab_parallel_cross_entropy(logits, torch.zeros(4, 1, dtype=torch.long), None, 50, fused=fused)
    with pytest.raises(ValueError, match="vocab_size 100 does not fit the 50 logit columns"):
        vocab_parallel_cross_entropy(logits, torch.full((4, 3), 60), None, 100, fused=fused)
