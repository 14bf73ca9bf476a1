"""``data.source = "indexed"``: Megatron .bin/.idx datasets -> (blended) GPT samples.

For each dataset prefix of ``data.paths`` (optionally weighted): open it memory-mapped, take
the train split of its documents (``data.split``), and build (or load from the cache) its GPT
sample index for as many samples as the blend will draw from it; with several datasets, blend
them in the given proportions. The index files are built by global rank 0 while the other ranks
wait, then loaded by everyone (``build_on_one_rank``): every rank must call :func:`indexed_source`.

The built-in demo corpus takes the same path: Python's documentation topics, one document each,
byte tokens with 0 (NUL, absent from the text) as the end-of-document id, written once as an
indexed dataset under the cache folder (:func:`builtin_prefix`).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os

import numpy as np

from tessera.config import DataConfig
from tessera.data.blend import BlendedDataset, parse_blend, size_weights
from tessera.data.gpt_dataset import GPTDataset, build_on_one_rank, split_documents
from tessera.data import remote
from tessera.data.indexed import IndexedDataset, IndexedDatasetWriter

BUILTIN_EOD = 0


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "tessera")


def builtin_prefix(cache_dir: str) -> str:
    """The demo corpus as an indexed dataset (written on first use; keyed by its content)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    texts = [topics[k].encode("utf-8") for k in sorted(topics)]
    digest = hashlib.sha256(b"\0".join(texts)).hexdigest()[:12]
    prefix = os.path.join(cache_dir, "builtin", f"pydoc-topics-{digest}")

    def write() -> str:
        if IndexedDataset.exists(prefix):
            return prefix
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        # One writer at a time per machine (ranks of other nodes, or another job, may get here
        # with a node-local cache): the writer replaces files, which a reader must not see.
        with open(prefix + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not IndexedDataset.exists(prefix):
                with IndexedDatasetWriter(prefix, np.uint8) as writer:
                    for text in texts:
                        writer.add_document(np.frombuffer(text + bytes([BUILTIN_EOD]), dtype=np.uint8))
        return prefix
    return build_on_one_rank(write)


def index_cache_beside(prefix: str) -> str:
    """Where a dataset's sample indices are cached without data.cache_dir: beside it (a dataset
    in an object store: under the local default cache)."""
    if remote.is_url(prefix):
        return os.path.join(default_cache_dir(), "index-cache")
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def indexed_source(data: DataConfig, seq_len: int, num_samples: int, seed: int, *, split: int = 0):
    """Samples ``[0, num_samples)`` of the blend (``split``: 0 train, 1 valid, 2 test)."""
    blend = parse_blend(data.paths)
    opened = [(IndexedDataset(prefix, data.cache_dir), prefix) for _, prefix in blend]
    parts = [split_documents(len(docs), data.split)[split] for docs, _ in opened]
    if blend[0][0] is None:  # paths without weights: each in proportion to its tokens in this split
        sizes = [int(docs.sequence_lengths[r.start:r.stop].sum(dtype=np.int64)) for (docs, _), r in zip(opened, parts)]
        blend = list(zip(size_weights(sizes), [prefix for _, prefix in blend]))
    datasets = []
    for (weight, prefix), (docs, _), documents in zip(blend, opened, parts):
        cache = data.cache_dir or index_cache_beside(prefix)
        need = num_samples if len(blend) == 1 else math.ceil(weight * num_samples * 1.005) + 1  # as Megatron
        datasets.append(build_on_one_rank(lambda: GPTDataset(docs, documents, seq_len, need, seed, cache,
                                                             name=prefix if remote.is_url(prefix)
                                                             else os.path.abspath(prefix))))
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, [w for w, _ in blend], num_samples)
