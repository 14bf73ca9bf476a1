"""The autograd collectives of tessera.tensor_parallel.mappings, forward and backward.

Every rank draws the same *full* tensors from one seeded generator, works on its own part of
them, and compares its forward output and its input gradient with what the unsharded maths
gives. The multi-rank convention (Megatron's) is that the total loss is the sum of each rank's
local loss, where a replicated output gets the same upstream gradient on every rank (and so is
counted once) and a TP-split output gets this rank's slice of the upstream gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tessera.tensor_parallel import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from tessera.tensor_parallel.mappings import group_rank, group_size
from tessera.testing import run_ranks

TIMEOUT = 90
TOL = dict(rtol=1e-6, atol=1e-6)
S, B, H = 8, 2, 12  # sequence divisible by 1, 2, 4 and hidden divisible by 1, 2, 4

ALL_FUNCTIONS = [
    copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region, gather_from_tp_region,
    scatter_to_sequence_region, gather_from_sequence_region, reduce_scatter_to_sequence_region,
]


# The ranks do not call assert_close (its first call imports torch.distributed.tensor, seconds of
# CPU per process) nor backward() with an explicit gradient tensor (which imports sympy): they
# record (label, actual, expected, exact) and the test process compares.


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _run(fn, x_leaf, upstream, **kw):
    """Forward, then backward with ``upstream`` as the output gradient; return (out, x grad)."""
    out = fn(x_leaf, **kw)
    (out * upstream).sum().backward()
    return out.detach(), x_leaf.grad


def _close(checks, label, actual, expected, exact=False):
    checks.append((label, actual.detach().clone(), expected.detach().clone(), exact))


def verify(results):
    """Compare what every rank recorded; return how many comparisons each rank made."""
    for rank, checks in enumerate(results):
        for label, actual, expected, exact in checks:
            tol = dict(rtol=0.0, atol=0.0) if exact else TOL
            assert_close(actual, expected, **tol, msg=lambda m: f"rank {rank} of {len(results)}: {label}: {m}")
    return [len(c) for c in results]


def _mappings_rank(rank: int, tp: int) -> list:
    tp_group = dist.group.WORLD
    assert group_size(tp_group) == tp and group_rank(tp_group) == rank
    g = torch.Generator().manual_seed(1234)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731 - same draws on every rank
    checks: list = []

    def check(label, actual, expected, exact=False):
        _close(checks, label, actual, expected, exact)

    def part(t, dim=0):
        return t.chunk(tp, dim=dim)[rank]

    # -- copy_to_tp_region (f): identity forward; backward sums every rank's gradient ----------
    # rank r computes 2 * x and receives the upstream gradient ups[r] (its consumer is TP-split)
    x, ups = randn(S, B, H), randn(tp, S, B, H)
    out, dx = _run(lambda t: copy_to_tp_region(t, tp_group) * 2.0, _leaf(x), ups[rank])
    ref_x = _leaf(x)
    sum(((ref_x * 2.0) * ups[r]).sum() for r in range(tp)).backward()
    check("copy_to_tp_region forward", out, x * 2.0, exact=True)
    check("copy_to_tp_region input grad", dx, ref_x.grad)

    # -- reduce_from_tp_region (g): all-reduce forward; identity backward ----------------------
    # rank r holds the partial parts[r]; the output is replicated, so every rank gets the same up
    parts, up = randn(tp, S, B, H), randn(S, B, H)
    x_leaf = _leaf(parts[rank])
    out, dx = _run(reduce_from_tp_region, x_leaf, up, group=tp_group)
    ref_parts = _leaf(parts)
    (ref_parts.sum(0) * up).sum().backward()
    check("reduce_from_tp_region forward", out, parts.sum(0))
    check("reduce_from_tp_region input grad", dx, ref_parts.grad[rank])
    check("reduce_from_tp_region leaves its input alone", x_leaf.detach(), parts[rank], exact=True)

    # -- scatter_to_tp_region: split the last dim; backward all-gathers ------------------------
    # rank r keeps slice r of a replicated x; its consumer gets slice r of the upstream gradient
    for shape in [(S, B, H), (5, H), (H,)]:
        x, up = randn(*shape), randn(*shape)
        out, dx = _run(scatter_to_tp_region, _leaf(x), part(up, -1), group=tp_group)
        ref_x = _leaf(x)
        (ref_x * up).sum().backward()  # sum over r of <x[..., r], up[..., r]> = <x, up>
        assert out.shape == part(x, -1).shape
        check(f"scatter_to_tp_region{list(shape)} forward", out, part(x, -1), exact=True)
        check(f"scatter_to_tp_region{list(shape)} input grad", dx, ref_x.grad, exact=True)

    # -- gather_from_tp_region: all-gather the last dim; backward keeps this rank's slice ------
    for shape in [(S, B, H), (5, H), (H,)]:
        x, up = randn(*shape), randn(*shape)
        x_leaf = part(x, -1).detach().requires_grad_()  # non-contiguous where tp > 1
        out, dx = _run(gather_from_tp_region, x_leaf, up, group=tp_group)
        ref_x = _leaf(x)
        (ref_x * up).sum().backward()
        assert out.shape == x.shape
        check(f"gather_from_tp_region{list(shape)} forward", out, x, exact=True)
        check(f"gather_from_tp_region{list(shape)} input grad", dx, part(ref_x.grad, -1), exact=True)

    # -- scatter_to_sequence_region: split dim 0; backward all-gathers -------------------------
    x, up = randn(S, B, H), randn(S, B, H)
    out, dx = _run(scatter_to_sequence_region, _leaf(x), part(up), group=tp_group)
    ref_x = _leaf(x)
    (ref_x * up).sum().backward()
    assert out.shape == (S // tp, B, H)
    check("scatter_to_sequence_region forward", out, part(x), exact=True)
    check("scatter_to_sequence_region input grad", dx, ref_x.grad, exact=True)

    # -- gather_from_sequence_region, reduce_grad=True: the consumer is TP-split, so every rank
    #    holds a different partial upstream gradient; backward reduce-scatters them ------------
    x, ups = randn(S, B, H), randn(tp, S, B, H)
    for kw in ({"reduce_grad": True}, {}):  # True is the default
        out, dx = _run(gather_from_sequence_region, _leaf(part(x)), ups[rank], group=tp_group, **kw)
        ref_x = _leaf(x)
        sum((ref_x * ups[r]).sum() for r in range(tp)).backward()
        check(f"gather_from_sequence_region({kw}) forward", out, x, exact=True)
        check(f"gather_from_sequence_region({kw}) input grad", dx, part(ref_x.grad))

    # -- gather_from_sequence_region, reduce_grad=False: the upstream gradient is complete (the
    #    same on every rank); backward only keeps this rank's slice ----------------------------
    x, up = randn(S, B, H), randn(S, B, H)
    out, dx = _run(gather_from_sequence_region, _leaf(part(x)), up, group=tp_group, reduce_grad=False)
    ref_x = _leaf(x)
    (ref_x * up).sum().backward()
    check("gather_from_sequence_region(reduce_grad=False) forward", out, x, exact=True)
    check("gather_from_sequence_region(reduce_grad=False) input grad", dx, part(ref_x.grad), exact=True)

    # -- reduce_scatter_to_sequence_region: sum the partials and keep this rank's sequence slice;
    #    backward all-gathers ------------------------------------------------------------------
    parts, up = randn(tp, S, B, H), randn(S, B, H)
    out, dx = _run(reduce_scatter_to_sequence_region, _leaf(parts[rank]), part(up), group=tp_group)
    ref_parts = _leaf(parts)
    (ref_parts.sum(0) * up).sum().backward()
    assert out.shape == (S // tp, B, H)
    check("reduce_scatter_to_sequence_region forward", out, part(parts.sum(0)))
    check("reduce_scatter_to_sequence_region input grad", dx, ref_parts.grad[rank])

    # -- round trips are the identity, gradient included ---------------------------------------
    x, up = randn(S, B, H), randn(S, B, H)
    out, dx = _run(lambda t: gather_from_sequence_region(scatter_to_sequence_region(t, tp_group), tp_group,
                                                         reduce_grad=False), _leaf(x), up)
    check("sequence scatter+gather forward", out, x, exact=True)
    check("sequence scatter+gather input grad", dx, up, exact=True)
    out, dx = _run(lambda t: gather_from_tp_region(scatter_to_tp_region(t, tp_group), tp_group), _leaf(x), up)
    check("tp scatter+gather forward", out, x, exact=True)
    check("tp scatter+gather input grad", dx, up, exact=True)

    if tp == 1:
        # a group of size 1 makes every function the identity: the very same tensor
        x = _leaf(randn(S, B, H))
        for fn in ALL_FUNCTIONS:
            assert fn(x, tp_group) is x, fn.__name__
    else:
        # the sequence functions refuse a length the group does not divide
        for fn in (scatter_to_sequence_region, reduce_scatter_to_sequence_region):
            try:
                fn(randn(S + 1, B, H), tp_group)
            except ValueError:
                pass
            else:
                raise AssertionError(f"{fn.__name__} accepted a sequence of {S + 1} at tp={tp}")
    return checks


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings_match_unsharded_maths(tp):
    counts = verify(run_ranks(_mappings_rank, tp, timeout=TIMEOUT))
    assert counts == [31] * tp


def _shared_gradient_rank(rank: int, tp: int) -> list:
    """Two replicated inputs enter the TP region through f and meet in an add. Autograd hands the
    add's gradient tensor to both branches, so f's backward must not all-reduce it in place: the
    branch that runs later would see an already-reduced gradient and be reduced a second time."""
    tp_group = dist.group.WORLD
    g = torch.Generator().manual_seed(5)
    x1, x2, ups = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g), \
        torch.randn(tp, S, B, H, generator=g)
    a_leaf, b_leaf = _leaf(x1), _leaf(x2)
    a = copy_to_tp_region(a_leaf, tp_group) * 2.0  # created first: its backward runs last
    z = copy_to_tp_region(b_leaf, tp_group) + a
    (z * ups[rank]).sum().backward()  # z feeds a TP-split computation: a per-rank upstream gradient
    ref_a, ref_b = _leaf(x1), _leaf(x2)
    sum(((ref_b + 2.0 * ref_a) * ups[r]).sum() for r in range(tp)).backward()
    checks: list = []
    _close(checks, "first input grad", a_leaf.grad, ref_a.grad)
    _close(checks, "second input grad", b_leaf.grad, ref_b.grad)
    return checks


def test_copy_to_tp_region_leaves_a_shared_gradient_alone():
    assert verify(run_ranks(_shared_gradient_rank, 2, timeout=TIMEOUT)) == [2, 2]


def test_none_group_is_identity():
    """Without a group (single rank, no torch.distributed) every mapping returns its input."""
    assert group_size(None) == 1 and group_rank(None) == 0
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in ALL_FUNCTIONS:
        assert fn(x, None) is x, fn.__name__
    assert gather_from_sequence_region(x, None, reduce_grad=False) is x
    # and gradients flow through unchanged
    up = torch.randn(4, 2, 6)
    y = x
    for fn in ALL_FUNCTIONS:
        y = fn(y, None)
    (y * up).sum().backward()
    assert torch.equal(x.grad, up)


def _compiled_rank(rank: int, tp: int) -> list:
    """A column-parallel linear between the SP (or plain TP) collectives, compiled: the traced
    forward and backward graphs hold tessera's opaque collective ops, not torch's functional
    collectives, and give the eager results exactly."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from tessera.tensor_parallel.layers import column_parallel_linear

    group, out = dist.group.WORLD, []
    for sp in (True, False):
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(S, B, H, generator=gen), torch.randn(6, H, generator=gen)
        x, w = (x.chunk(tp)[rank] if sp else x).requires_grad_(), w.requires_grad_()

        def f(x, w):
            y = column_parallel_linear(torch.nn.functional.layer_norm(x, (H,)), w, None, group, sequence_parallel=sp)
            z = y @ torch.ones(6, H) * (rank + 1)
            return reduce_scatter_to_sequence_region(z, group) if sp else reduce_from_tp_region(z, group)

        graphs = []

        def capture(gm, _):
            graphs.append(str(gm.graph))
            return make_boxed_func(gm)

        eager = f(x, w)
        eager.square().sum().backward()
        expected = (eager.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)(x, w)
        compiled.square().sum().backward()
        out.append((sp, [g.count("tessera.") for g in graphs], [g.count("_c10d_functional") for g in graphs],
                    all(torch.equal(a, b) for a, b in zip((compiled.detach(), x.grad, w.grad), expected))))
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_compiled_tp_collectives_are_opaque_synchronous_ops():
    """Under torch.compile the TP collectives are tessera's custom ops (one synchronous call each,
    as eager runs them), never functional collectives that the compiler schedules around."""
    for per_rank in run_ranks(_compiled_rank, 2, timeout=TIMEOUT):
        assert per_rank == [(True, [2, 2], [0, 0], True), (False, [1, 1], [0, 0], True)]
