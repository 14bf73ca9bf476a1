"""``data.source = "indexed"``: Megatron .bin/.idx datasets -> (blended) GPT samples.

For each dataset prefix of ``data.paths``: open it memory-mapped, take the part of its documents
that ``data.split`` gives the split asked for, and build (or load from the cache) its GPT indices;
with several datasets, blend them. Sample counts follow megatron-core's
``BlendedMegatronDatasetBuilder``, so the stream is megatron-core's sample for sample:

- one path without a weight: a ``GPTDataset`` of ``num_samples``;
- weighted paths (one or more): each dataset built for ``ceil(ceil(n * w) * 1.005)`` samples, a
  blend of ``sum(ceil(n * w))`` (:func:`~tessera.data.blend.blend_budgets`);
- several paths without weights: one epoch of each, blended in proportion to those epochs'
  samples, ``min(n, their sum)`` long. Past that sum megatron-core's blend ends; tessera goes on,
  building each dataset for its share of ``n`` as for weights in that proportion (a stream
  megatron-core does not have).

The index files are built by global rank 0 while the other ranks wait, then loaded by everyone
(``build_on_one_rank``): every rank must call :func:`indexed_source`.

The built-in demo corpus takes the same path: Python's documentation topics, one document each,
byte tokens with 0 (NUL, absent from the text) as the end-of-document id, written once as an
indexed dataset under the cache folder (:func:`builtin_prefix`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os

import numpy as np

from tessera.config import DataConfig
from tessera.data.blend import BlendedDataset, blend_budgets, parse_blend
from tessera.data.gpt_dataset import GPTDataset, build_on_one_rank, split_documents
from tessera.data import remote
from tessera.data.indexed import IndexedDataset, IndexedDatasetWriter
from tessera.data.indices import normalize

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
    prefixes = [prefix for _, prefix in blend]
    opened = [IndexedDataset(prefix, data.cache_dir) for prefix in prefixes]
    parts = [split_documents(len(docs), data.split)[split] for docs in opened]

    def dataset(d: int, samples: int | None) -> GPTDataset:
        cache = data.cache_dir or index_cache_beside(prefixes[d])
        name = prefixes[d] if remote.is_url(prefixes[d]) else os.path.abspath(prefixes[d])
        return build_on_one_rank(lambda: GPTDataset(opened[d], parts[d], seq_len, samples, seed, cache,
                                                    name=name, order=data.sample_order))

    weights = [w for w, _ in blend]
    if weights[0] is None:  # no weights: one path is the dataset itself; several, one epoch of each
        if len(blend) == 1:
            return dataset(0, num_samples)
        datasets = [dataset(d, None) for d in range(len(blend))]
        weights = [len(ds) for ds in datasets]
        if num_samples <= sum(weights):
            return BlendedDataset(datasets, weights, num_samples)
        weights = normalize(weights)  # (past megatron-core's end: each dataset as far as its share)
    targets, builds = blend_budgets(weights, num_samples)
    return BlendedDataset([dataset(d, n) for d, n in enumerate(builds)], weights, sum(targets))
