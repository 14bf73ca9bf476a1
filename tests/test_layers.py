"""ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding against the unsharded maths.

On every rank the layer is built with the TP group and a tp=1 reference (no group) is built next
to it; both are initialised from a generator with the same seed. Then:

(a) the local shard equals the matching slice of the reference weight (layout-independent init);
(b) the forward output equals F.linear / F.embedding on the full tensors;
(c) the input gradient and the weight/bias gradients equal the matching slices of the reference
    gradients. Under sequence parallelism the input is this rank's sequence slice (dim 0 of
    [s, b, h]) and the bias gradient of the row-parallel layer is partial: summed over TP it is
    the reference.

Ranks record (label, actual, expected) and the test process compares (see test_mappings.py for
why the ranks avoid assert_close).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from tessera.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from tessera.testing import run_ranks

TIMEOUT = 120
TOL = dict(rtol=1e-5, atol=1e-6)
S, B = 8, 2          # sequence divisible by 1, 2, 4
IN, OUT = 12, 16     # both divisible by 1, 2, 4
QKV = [16, 8, 8]     # a fused Q, K, V (grouped-query: K and V smaller), each divisible by 4
VOCAB, HIDDEN = 50, 6


def verify(results):
    for rank, checks in enumerate(results):
        for label, actual, expected, exact in checks:
            tol = dict(rtol=0.0, atol=0.0) if exact else TOL
            assert_close(actual, expected, **tol, msg=lambda m: f"rank {rank} of {len(results)}: {label}: {m}")
    return [sorted(label for label, *_ in c) for c in results]


class _Recorder:
    def __init__(self, rank: int, tp: int, group):
        self.rank, self.tp, self.group = rank, tp, group
        self.checks: list = []
        self.gen = torch.Generator().manual_seed(99)

    def close(self, label, actual, expected, exact=False):
        assert actual.shape == expected.shape, f"{label}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        self.checks.append((label, actual.detach().clone(), expected.detach().clone(), exact))

    def randn(self, *shape):  # the same draws on every rank
        return torch.randn(*shape, generator=self.gen)

    def part(self, t, dim):
        return t.chunk(self.tp, dim=dim)[self.rank]

    def all_reduce(self, t):
        t = t.detach().clone()
        if self.tp > 1:
            dist.all_reduce(t, group=self.group)
        return t


def _fused_rows(r: _Recorder, full: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """This rank's rows of a fused [sum(sizes), ...] tensor: its slice of each logical part."""
    return torch.cat([r.part(p, 0) for p in full.split(sizes, dim=0)], dim=0)


def _check_column(r: _Recorder, name: str, sizes, *, gather_output=False, sequence_parallel=False,
                  bias=True, seed=0, comm_overlap=False):
    sizes_list = [sizes] if isinstance(sizes, int) else list(sizes)
    out_features = sum(sizes_list)
    layer = ColumnParallelLinear(IN, sizes, tp_group=r.group, bias=bias, gather_output=gather_output,
                                 sequence_parallel=sequence_parallel, comm_overlap=comm_overlap)
    ref = ColumnParallelLinear(IN, sizes, tp_group=None, bias=bias)
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    ref.reset_parameters(torch.Generator().manual_seed(seed))
    assert layer.weight.shape == (out_features // r.tp, IN) and getattr(layer.weight, "tensor_parallel", False)
    assert ref.weight.shape == (out_features, IN)
    assert ref.weight.std() > 0.01, "reset_parameters did not draw the weight"
    # (a) layout-independent initialisation
    r.close(f"{name}: init weight shard", layer.weight, _fused_rows(r, ref.weight, sizes_list), exact=True)
    if bias:
        r.close(f"{name}: init bias is zero", layer.bias, torch.zeros(out_features // r.tp), exact=True)
        # give the bias values so that the forward checks that it is added (and where)
        full_bias = r.randn(out_features)
        with torch.no_grad():
            ref.bias.copy_(full_bias)
            layer.bias.copy_(_fused_rows(r, full_bias, sizes_list))

    x, up = r.randn(S, B, IN), r.randn(S, B, out_features)
    ref_x = x.clone().requires_grad_()
    y_ref = F.linear(ref_x, ref.weight, ref.bias)
    (y_ref * up).sum().backward()
    r.close(f"{name}: the tp=1 layer is F.linear", ref(x), y_ref, exact=True)

    x_local = (r.part(x, 0) if sequence_parallel else x).clone().requires_grad_()
    y = layer(x_local)
    # (b) forward: the full output when gathered, else this rank's (fused) output columns
    if gather_output:
        expected_y, up_local = y_ref, up
    else:
        expected_y, up_local = _fused_rows(r, y_ref.movedim(-1, 0), sizes_list).movedim(0, -1), \
            _fused_rows(r, up.movedim(-1, 0), sizes_list).movedim(0, -1)
    r.close(f"{name}: forward", y, expected_y)
    (y * up_local).sum().backward()
    # (c) gradients
    expected_dx = r.part(ref_x.grad, 0) if sequence_parallel else ref_x.grad
    r.close(f"{name}: input grad", x_local.grad, expected_dx)
    r.close(f"{name}: weight grad", layer.weight.grad, _fused_rows(r, ref.weight.grad, sizes_list))
    if bias:
        r.close(f"{name}: bias grad", layer.bias.grad, _fused_rows(r, ref.bias.grad, sizes_list))


def _check_row(r: _Recorder, name: str, *, input_is_parallel=True, sequence_parallel=False, bias=True, seed=0):
    layer = RowParallelLinear(IN, OUT, tp_group=r.group, bias=bias, input_is_parallel=input_is_parallel,
                              sequence_parallel=sequence_parallel)
    ref = RowParallelLinear(IN, OUT, tp_group=None, bias=bias)
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    ref.reset_parameters(torch.Generator().manual_seed(seed))
    assert layer.weight.shape == (OUT, IN // r.tp) and getattr(layer.weight, "tensor_parallel", False)
    assert ref.weight.std() > 0.01, "reset_parameters did not draw the weight"
    r.close(f"{name}: init weight shard", layer.weight, r.part(ref.weight, 1), exact=True)
    if bias:
        r.close(f"{name}: init bias is zero", layer.bias, torch.zeros(OUT), exact=True)
        assert getattr(layer.bias, "sequence_parallel", False) == sequence_parallel, \
            f"{name}: bias.sequence_parallel must be {sequence_parallel}"
        full_bias = r.randn(OUT)
        with torch.no_grad():
            ref.bias.copy_(full_bias)
            layer.bias.copy_(full_bias)

    x, up = r.randn(S, B, IN), r.randn(S, B, OUT)
    ref_x = x.clone().requires_grad_()
    y_ref = F.linear(ref_x, ref.weight, ref.bias)
    (y_ref * up).sum().backward()
    r.close(f"{name}: the tp=1 layer is F.linear", ref(x), y_ref, exact=True)

    x_local = (r.part(x, -1) if input_is_parallel else x).clone().requires_grad_()
    y = layer(x_local)
    # (b) forward: replicated, or this rank's sequence slice under sequence parallelism
    expected_y, up_local = (r.part(y_ref, 0), r.part(up, 0)) if sequence_parallel else (y_ref, up)
    r.close(f"{name}: forward", y, expected_y)
    (y * up_local).sum().backward()
    # (c) gradients
    expected_dx = r.part(ref_x.grad, -1) if input_is_parallel else ref_x.grad
    r.close(f"{name}: input grad", x_local.grad, expected_dx)
    r.close(f"{name}: weight grad", layer.weight.grad, r.part(ref.weight.grad, 1))
    if bias:
        if sequence_parallel:
            # each rank saw a sequence slice: its bias gradient is that slice's part of the sum
            r.close(f"{name}: partial bias grad", layer.bias.grad, r.part(up, 0).sum((0, 1)))
            r.close(f"{name}: bias grad summed over TP", r.all_reduce(layer.bias.grad), ref.bias.grad)
        else:
            r.close(f"{name}: bias grad", layer.bias.grad, ref.bias.grad)


def _check_mlp(r: _Recorder, name: str, *, sequence_parallel: bool):
    """Column then row, as in a transformer MLP: one all-reduce (or all-gather + reduce-scatter)."""
    col = ColumnParallelLinear(IN, OUT, tp_group=r.group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(OUT, IN, tp_group=r.group, sequence_parallel=sequence_parallel)
    ref_col = ColumnParallelLinear(IN, OUT, tp_group=None)
    ref_row = RowParallelLinear(OUT, IN, tp_group=None)
    for i, (a, b) in enumerate([(col, ref_col), (row, ref_row)]):
        a.reset_parameters(torch.Generator().manual_seed(10 + i))
        b.reset_parameters(torch.Generator().manual_seed(10 + i))
    b1, b2 = r.randn(OUT), r.randn(IN)
    with torch.no_grad():
        ref_col.bias.copy_(b1), col.bias.copy_(r.part(b1, 0)), ref_row.bias.copy_(b2), row.bias.copy_(b2)
    x, up = r.randn(S, B, IN), r.randn(S, B, IN)
    ref_x = x.clone().requires_grad_()
    y_ref = ref_row(F.gelu(ref_col(ref_x)))
    (y_ref * up).sum().backward()
    x_local = (r.part(x, 0) if sequence_parallel else x).clone().requires_grad_()
    y = row(F.gelu(col(x_local)))
    expected_y, up_local = (r.part(y_ref, 0), r.part(up, 0)) if sequence_parallel else (y_ref, up)
    r.close(f"{name}: forward", y, expected_y)
    (y * up_local).sum().backward()
    r.close(f"{name}: input grad", x_local.grad, r.part(ref_x.grad, 0) if sequence_parallel else ref_x.grad)
    r.close(f"{name}: column weight grad", col.weight.grad, r.part(ref_col.weight.grad, 0))
    r.close(f"{name}: column bias grad", col.bias.grad, r.part(ref_col.bias.grad, 0))
    r.close(f"{name}: row weight grad", row.weight.grad, r.part(ref_row.weight.grad, 1))
    row_bias_grad = r.all_reduce(row.bias.grad) if sequence_parallel else row.bias.grad
    r.close(f"{name}: row bias grad", row_bias_grad, ref_row.bias.grad)


def _check_embedding(r: _Recorder, name: str, *, pad_multiple: int, seed=0):
    layer = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=r.group, pad_multiple=pad_multiple)
    ref = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=None, pad_multiple=pad_multiple)
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    ref.reset_parameters(torch.Generator().manual_seed(seed))
    padded = padded_vocab_size(VOCAB, r.tp, pad_multiple)
    assert padded >= VOCAB and padded % (r.tp * pad_multiple) == 0 and padded - VOCAB < r.tp * pad_multiple, \
        f"padded_vocab_size({VOCAB}, {r.tp}, {pad_multiple}) = {padded}"
    rows = padded // r.tp
    assert layer.padded_vocab == padded and layer.weight.shape == (rows, HIDDEN)
    assert layer.vocab_start == r.rank * rows and getattr(layer.weight, "tensor_parallel", False)
    assert ref.weight[:VOCAB].std() > 0.01, "reset_parameters did not draw the weight"
    r.close(f"{name}: reference padding rows are zero", ref.weight[VOCAB:], torch.zeros_like(ref.weight[VOCAB:]),
            exact=True)
    # the full table at this tp's padding: the real rows of the reference, then zeros
    full = torch.zeros(padded, HIDDEN)
    full[:VOCAB] = ref.weight.detach()[:VOCAB]
    r.close(f"{name}: init weight shard", layer.weight, r.part(full, 0), exact=True)

    # every id at least once (so every rank's range and its edges are hit), then random ones
    ids = torch.cat([torch.randperm(VOCAB, generator=r.gen), torch.randint(VOCAB, (14,), generator=r.gen)])
    ids = ids.view(S, 8)
    up = r.randn(S, 8, HIDDEN)
    ref_w = ref.weight.detach()[:VOCAB].clone().requires_grad_()
    y_ref = F.embedding(ids, ref_w)
    (y_ref * up).sum().backward()
    r.close(f"{name}: the tp=1 layer is F.embedding", ref(ids), y_ref, exact=True)

    y = layer(ids)
    r.close(f"{name}: forward", y, y_ref)
    (y * up).sum().backward()
    full_grad = torch.zeros(padded, HIDDEN)
    full_grad[:VOCAB] = ref_w.grad
    r.close(f"{name}: weight grad (padding rows zero)", layer.weight.grad, r.part(full_grad, 0))


def _layers_rank(rank: int, tp: int) -> list:
    r = _Recorder(rank, tp, dist.group.WORLD)
    _check_column(r, "column", OUT, seed=1)
    _check_column(r, "column no bias", OUT, bias=False, seed=2)
    _check_column(r, "column gather_output", OUT, gather_output=True, seed=3)
    _check_column(r, "column fused qkv", QKV, seed=4)
    _check_column(r, "column sequence_parallel", OUT, sequence_parallel=True, seed=5)
    _check_column(r, "column fused qkv sequence_parallel", QKV, sequence_parallel=True, seed=6)
    _check_column(r, "column gather_output sequence_parallel", OUT, gather_output=True,
                  sequence_parallel=True, seed=7)
    # the input gradient's collective overlapped with the weight-gradient GEMM: the same maths
    _check_column(r, "column overlap", OUT, seed=8, comm_overlap=True)
    _check_column(r, "column sequence_parallel overlap", QKV, sequence_parallel=True, seed=9, comm_overlap=True)
    _check_row(r, "row input_is_parallel", seed=11)
    _check_row(r, "row replicated input", input_is_parallel=False, seed=12)
    _check_row(r, "row no bias", bias=False, seed=13)
    _check_row(r, "row sequence_parallel", sequence_parallel=True, seed=14)
    _check_mlp(r, "mlp", sequence_parallel=False)
    _check_mlp(r, "mlp sequence_parallel", sequence_parallel=True)
    _check_embedding(r, "embedding pad 1", pad_multiple=1, seed=21)
    _check_embedding(r, "embedding pad 8", pad_multiple=8, seed=22)

    # what the layers refuse
    def refuses(make, what):
        try:
            make()
        except ValueError:
            return
        raise AssertionError(f"accepted {what}")

    refuses(lambda: ColumnParallelLinear(IN, QKV, tp_group=r.group, gather_output=True),
            "gather_output on a fused layer")
    refuses(lambda: RowParallelLinear(IN, OUT, tp_group=r.group, input_is_parallel=False, sequence_parallel=True),
            "sequence parallelism with a replicated row-parallel input")
    if tp > 1:
        refuses(lambda: ColumnParallelLinear(IN, tp + 1, tp_group=r.group), f"{tp + 1} outputs at tp={tp}")
        refuses(lambda: ColumnParallelLinear(IN, [4 * tp, tp + 1], tp_group=r.group),
                f"a fused part of {tp + 1} at tp={tp}")
        refuses(lambda: RowParallelLinear(tp + 1, OUT, tp_group=r.group), f"{tp + 1} inputs at tp={tp}")
    return r.checks


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # (4 ranks: the whole suite)
def test_layers_match_unsharded_maths(tp):
    labels = verify(run_ranks(_layers_rank, tp, timeout=TIMEOUT))
    assert all(lab == labels[0] for lab in labels)
    assert len(labels[0]) == 110, len(labels[0])  # every check above ran


@pytest.mark.parametrize("tp,pad_multiple,expected", [
    (1, 1, 50), (2, 1, 50), (4, 1, 52), (1, 8, 56), (2, 8, 64), (4, 8, 64), (4, 16, 64), (8, 1, 56),
])
def test_padded_vocab_size(tp, pad_multiple, expected):
    assert padded_vocab_size(VOCAB, tp, pad_multiple) == expected


def test_model_hands_the_tp_options_to_every_linear_layer():
    from tessera.config import ModelConfig
    from tessera.models import GPTModel, TPContext
    from tessera.tensor_parallel.layers import ColumnParallelLinear as Col, RowParallelLinear as Row
    for family in ("gpt2", "llama"):
        cfg = ModelConfig(family=family, hidden=32, heads=4, kv_heads=2 if family == "llama" else 0, layers=2,
                          seq_len=8, vocab_size=40, tie_embeddings=False)
        model = GPTModel(cfg, TPContext(comm_overlap=True))
        layers = [m for m in model.modules() if isinstance(m, (Col, Row))]
        assert len(layers) == 2 * 4 + 1, family
        assert all(m.comm_overlap for m in layers if isinstance(m, Col)), family


def test_live_graph_search_skips_dead_weak_proxies():
    """torch.compile leaves weakref proxies whose referent is gone; the search for the CUDA graphs
    that make_graphed_callables made walks every tracked object and must not trip on them
    (isinstance on a dead proxy raises ReferenceError: train.cuda_graphs with
    train.fused_elementwise failed so on the GPU)."""
    import weakref

    from tessera.training.cuda_graphs import _live_graphs

    class Referent:
        pass

    obj = Referent()
    proxy = weakref.proxy(obj)
    del obj
    with pytest.raises(ReferenceError):
        isinstance(proxy, torch.cuda.CUDAGraph)
    assert _live_graphs() == []
