"""Tensor parallelism: autograd collectives, parallel layers, vocab-parallel loss, RNG, data."""

from tessera.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tessera.tensor_parallel.data import broadcast_batch
from tessera.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    padded_vocab_size,
)
from tessera.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from tessera.tensor_parallel.random import RNGTracker, stable_seed

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "RNGTracker",
    "broadcast_batch", "copy_to_tp_region", "gather_from_sequence_region", "gather_from_tp_region",
    "mark_sequence_parallel", "padded_vocab_size", "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region", "scatter_to_sequence_region", "scatter_to_tp_region",
    "stable_seed", "vocab_parallel_cross_entropy",
]
