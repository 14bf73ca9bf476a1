"""Data: indexed datasets (Megatron .bin/.idx), GPT sample indices, blending, sample sources,
the byte tokenizer and data-parallel micro-batching.

Names are imported on first use, so that ``tessera preprocess`` and its worker processes (numpy
and tokenizers only) do not pay for importing torch through the loader.
"""

import importlib

_WHERE = {
    "BlendedDataset": "blend", "parse_blend": "blend",
    "GPTDataset": "gpt_dataset", "split_documents": "indices",
    "IndexedDataset": "indexed", "IndexedDatasetError": "indexed", "IndexedDatasetWriter": "indexed",
    "MicroBatches": "loader", "microbatch_counts": "loader",
    "SyntheticTokens": "sources",
    "ByteTokenizer": "tokenizer", "FileTokenizer": "tokenizer", "sample_tokenizer": "tokenizer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'tessera.data' has no attribute '{name}'")
    return getattr(importlib.import_module(f"tessera.data.{_WHERE[name]}"), name)
