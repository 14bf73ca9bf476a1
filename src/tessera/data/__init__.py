"""Data: sample sources, the byte tokenizer and data-parallel micro-batching."""

from tessera.data.loader import MicroBatches, microbatch_counts
from tessera.data.sources import BuiltinCorpus, SyntheticTokens
from tessera.data.tokenizer import ByteTokenizer

__all__ = ["BuiltinCorpus", "ByteTokenizer", "MicroBatches", "SyntheticTokens", "microbatch_counts"]
