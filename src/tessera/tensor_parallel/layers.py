"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

A transformer block is "column then row": the first matrix A is split by output columns, each
rank computes its slice ``Y_i = X A_i`` with no communication, the second matrix B is split by
input rows, each rank computes the partial ``Z_i = Y_i B_i`` and one all-reduce gives
``Z = sum_i Z_i``. Under sequence parallelism the replicated input X is instead held as sequence
slices: the column layer all-gathers it and the row layer reduce-scatters its output.

Initialisation is layout-independent: ``reset_parameters(generator)`` draws the *full* matrix
from the generator and keeps this rank's slice, so tp=1 and tp=4 start from the same model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.precision.fp8 import Float8Recipe, Float8WeightCache
from tessera.tensor_parallel.fp8_linear import fp8_linear
from tessera.tensor_parallel.wgrad import WeightGradStore, linear
from tessera.tensor_parallel.mappings import (
    Group,
    column_parallel_matmul,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    group_rank,
    group_size,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} = {n} is not divisible by the TP size {d}")
    return n // d


def mark_sequence_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag a TP-replicated parameter that sees only a sequence slice: its gradient is a partial
    sum per TP rank and must be all-reduced over TP before the optimizer step."""
    param.sequence_parallel = True
    return param


def mark_tensor_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag a parameter whose TP ranks hold different slices (it counts once per rank in norms)."""
    param.tensor_parallel = True
    return param


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    step = multiple * tp
    return -(-vocab_size // step) * step


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, tp_group: Group,
                           sequence_parallel: bool = False, gather_output: bool = False,
                           wgrad_store: WeightGradStore | None = None, fuse_wgrad: bool = True,
                           comm_overlap: bool = False, fp8: Float8Recipe | None = None,
                           fp8_cache: Float8WeightCache | None = None) -> Tensor:
    """The column-parallel product with a given local weight [out/tp, in] (also used by a tied
    output layer, whose weight is the embedding's: ``fuse_wgrad=False`` as that weight's
    gradient has a second term, from the lookup). ``comm_overlap`` (tp > 1): the input gradient's
    reduction overlaps the weight-gradient GEMM (one autograd function for collective + matmul).
    ``fp8``: the GEMMs in float8, scaled over the whole weight (tensor_parallel/fp8_linear.py);
    tensorwise under sequence parallelism, the input is gathered in fp8. ``fp8_cache``: the
    weight's fp8 copy reused across a step's micro-batches."""
    if comm_overlap and fp8 is None and group_size(tp_group) > 1:
        y = column_parallel_matmul(x, weight, bias, tp_group, sequence_parallel, wgrad_store, fuse_wgrad)
        return gather_from_tp_region(y, tp_group) if gather_output else y
    if fp8 is not None and fp8.scaling == "tensorwise" and sequence_parallel:
        y = fp8_linear(x, weight, bias, fp8, tp_group, "n", wgrad_store, fp8_cache, gather=True)
        return gather_from_tp_region(y, tp_group) if gather_output else y
    if sequence_parallel:
        x = gather_from_sequence_region(x, tp_group, reduce_grad=True)
    else:
        x = copy_to_tp_region(x, tp_group)
    if fp8 is not None:
        y = fp8_linear(x, weight, bias, fp8, tp_group, "n", wgrad_store, fp8_cache)
    else:
        y = linear(x, weight, bias, wgrad_store, fuse_wgrad)
    return gather_from_tp_region(y, tp_group) if gather_output else y


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with A split by output columns over the TP group.

    ``output_sizes`` lets one layer hold several logical matrices side by side (Q, K, V or
    gate, up): each is split over TP on its own and the local weight is the concatenation of the
    local slices, so the fused layer is exact at any tp.
    """

    def __init__(self, in_features: int, output_sizes: int | list[int], *, tp_group: Group,
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 init_std: float = 0.02, wgrad_store: WeightGradStore | None = None,
                 comm_overlap: bool = False, fp8: Float8Recipe | None = None,
                 fp8_cache: Float8WeightCache | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.wgrad_store, self.comm_overlap, self.fp8, self.fp8_cache = wgrad_store, comm_overlap, fp8, fp8_cache
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.tp_group, self.tp = tp_group, group_size(tp_group)
        if gather_output and len(self.output_sizes) > 1:
            raise ValueError("gather_output of a fused (multi-output) layer would interleave its outputs")
        self.local_sizes = [_divide(n, self.tp, "output features") for n in self.output_sizes]
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.gather_output, self.sequence_parallel, self.init_std = gather_output, sequence_parallel, init_std
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(sum(self.local_sizes), in_features, **kw)))
        self.bias = mark_tensor_parallel(nn.Parameter(torch.empty(sum(self.local_sizes), **kw))) if bias else None

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        full = torch.empty(self.out_features, self.in_features, device=self.weight.device)
        full.normal_(0.0, self.init_std, generator=generator)
        rank = group_rank(self.tp_group)
        parts = [p.chunk(self.tp, dim=0)[rank] for p in full.split(self.output_sizes, dim=0)]
        self.weight.copy_(torch.cat(parts, dim=0))
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """x: [s/tp if sequence_parallel else s, b, in] -> [s, b, out/tp] (or [s, b, out] gathered).

        ``weight`` overrides the layer's own (a tied output layer passes the embedding's)."""
        return column_parallel_linear(x, self.weight if weight is None else weight, self.bias,
                                      self.tp_group, self.sequence_parallel, self.gather_output,
                                      self.wgrad_store, comm_overlap=self.comm_overlap, fp8=self.fp8,
                                      fp8_cache=self.fp8_cache if weight is None else None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes} / tp={self.tp}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """``Z = Y B + b`` with B split by input rows; the partial products are summed over TP
    (all-reduce, or reduce-scatter along the sequence under sequence parallelism)."""

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_std: float = 0.02, wgrad_store: WeightGradStore | None = None,
                 fp8: Float8Recipe | None = None, fp8_cache: Float8WeightCache | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.wgrad_store, self.fp8, self.fp8_cache = wgrad_store, fp8, fp8_cache
        self.tp_group, self.tp = tp_group, group_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs a row-parallel input that is already split")
        self.init_std = init_std
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(out_features, _divide(in_features, self.tp, "input features"), **kw)))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        full = torch.empty(self.out_features, self.in_features, device=self.weight.device)
        full.normal_(0.0, self.init_std, generator=generator)
        self.weight.copy_(full.chunk(self.tp, dim=1)[group_rank(self.tp_group)])
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """x: [s, b, in/tp] -> [s/tp if sequence_parallel else s, b, out]."""
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        if self.fp8 is not None:
            z = fp8_linear(x, self.weight, None, self.fp8, self.tp_group, "k", self.wgrad_store, self.fp8_cache)
        else:
            z = linear(x, self.weight, None, self.wgrad_store)
        if self.sequence_parallel:
            z = reduce_scatter_to_sequence_region(z, self.tp_group)
        else:
            z = reduce_from_tp_region(z, self.tp_group)
        return z if self.bias is None else z + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} / tp={self.tp}, out={self.out_features}, bias={self.bias is not None}"


def init_vocab_rows(weight: Tensor, vocab_size: int, std: float, tp_group: Group,
                    generator: torch.Generator) -> None:
    """Fill this rank's rows of a [padded_vocab, hidden] matrix: the real rows from the full
    normal draw, the padding rows with zeros (they are never looked up nor predicted)."""
    tp, rank = group_size(tp_group), group_rank(tp_group)
    rows, hidden = weight.shape
    full = torch.zeros(rows * tp, hidden, device=weight.device)
    full[:vocab_size].normal_(0.0, std, generator=generator)
    with torch.no_grad():
        weight.copy_(full.chunk(tp, dim=0)[rank])


def lookup_row_sums(ids: Tensor, grad: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """A lookup's gradient (``grad`` [n, hidden] for ``ids`` [n] of a ``rows``-row table) as n
    (row, fp32 sum) pairs, without a host sync. The ids are numbered by distinct value (a stable
    sort), PyTorch's embedding backward sums each one's rows into an [n, hidden] table (in
    parallel over long runs of one id: frequent tokens, padding, ids masked at tp > 1), and each
    table row gets its vocabulary row; the rows past the distinct count hold zeros and go to
    rows ``i % rows``, so no row is named more than ``n / rows + 1`` times (twice for a
    vocabulary larger than the micro-batch)."""
    n = ids.numel()
    sorted_ids, order = ids.sort(stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    number = first.cumsum(0) - 1  # each sorted position's distinct id, 0 ..
    compact = torch.empty_like(ids)
    compact[order] = number
    sums = torch.ops.aten.embedding_dense_backward(grad.float(), compact, n, -1, False)
    target = torch.arange(n, device=ids.device) % rows
    target[number] = sorted_ids  # (a distinct id's positions all write the same row)
    return target, sums


class _LookupIntoMainGrad(torch.autograd.Function):
    """An embedding lookup whose backward adds the rows' gradients into the weight's main
    gradient (``store.sink.accumulate_rows``) rather than returning a dense [vocab, hidden] one."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, store: WeightGradStore) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.store = weight, store
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        rows, sums = lookup_row_sums(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), ctx.weight.shape[0])
        ctx.store.sink.accumulate_rows(ctx.weight, rows, sums)
        return None, None, None


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary is split over TP: each rank looks up the ids in its
    range, zeros the rest, and the partial rows are summed over TP. With a fusing
    ``wgrad_store`` (gradient-accumulation fusion, set by the model where the weight is not
    also its output layer) the lookup's gradient goes straight into the main gradient's rows."""

    wgrad_store: WeightGradStore | None = None

    def __init__(self, vocab_size: int, hidden: int, *, tp_group: Group, pad_multiple: int = 1,
                 init_std: float = 0.02, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.tp_group, self.tp = tp_group, group_size(tp_group)
        self.vocab_size, self.init_std = vocab_size, init_std
        self.padded_vocab = padded_vocab_size(vocab_size, self.tp, pad_multiple)
        rows = self.padded_vocab // self.tp
        self.vocab_start = group_rank(tp_group) * rows
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(rows, hidden, device=device, dtype=dtype)))

    def reset_parameters(self, generator: torch.Generator) -> None:
        init_vocab_rows(self.weight, self.vocab_size, self.init_std, self.tp_group, generator)

    def forward(self, ids: Tensor) -> Tensor:
        """ids: any shape of token ids -> [*ids.shape, hidden], complete on every TP rank.
        Ids must lie in ``[0, vocab_size)`` (the trainer checks its data's, ``data/loader.py``):
        at tp=1 another id is an index error, at tp > 1 no rank owns it and its row is zeros."""
        if self.tp == 1:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.weight.shape[0])
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp_group)

    def _lookup(self, ids: Tensor) -> Tensor:
        store = self.wgrad_store
        if store is not None and store.fuse and self.weight.requires_grad and torch.is_grad_enabled():
            return _LookupIntoMainGrad.apply(ids, self.weight, store)
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} (padded {self.padded_vocab}) / tp={self.tp}, hidden={self.weight.shape[1]}"


def scaled_init_std(std: float, layers: int) -> float:
    """GPT-2's residual-branch output scaling: std / sqrt(2 * layers)."""
    return std / math.sqrt(2.0 * layers)
