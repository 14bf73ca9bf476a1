"""Documents to GPT training samples: the three indices of indices.py, cached, and read.

A GPT sample is ``seq_len + 1`` consecutive tokens of one long stream made by concatenating the
split's documents (inputs are ``tokens[:-1]``, labels ``tokens[1:]``). Consecutive samples share
one token: sample ``j`` covers stream positions ``[j * seq_len, (j + 1) * seq_len]``, so every
token is a label exactly once per epoch. Three indices describe the stream, as in megatron-core's
``GPTDataset`` (indices.py builds them):

- **document index** ``(num_epochs * num_docs,)``: document ids in stream order, the split's
  documents once per epoch, shuffled.
- **sample index** ``(num_samples + 1, 2)``: row ``j`` is ``(position in the document index,
  token offset in that document)`` of sample ``j``'s first token; row ``j + 1`` locates its last.
- **shuffle index** ``(num_samples,)``: the order in which samples are served.

``order="megatron"`` (the default, ``data.sample_order``) gives megatron-core's indices value for
value, so sample ``i`` is megatron-core's sample ``i``; ``order="epochs"`` shuffles each epoch
apart, so that a longer run serves the same samples first (indices.py says why they differ).

The indices are cached as ``.npy`` files under a sha256 key of everything they depend on (the
order and :data:`INDEX_VERSION` too); with several ranks, :func:`build_on_one_rank` lets rank 0
build while the others wait, then load.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np

from tessera.data.indices import (build_sample_index, epoch_indices, megatron_indices, num_epochs_needed,
                                  parse_split, split_documents)

__all__ = ["GPTDataset", "build_on_one_rank", "build_sample_index", "parse_split", "split_documents", "ORDERS"]

# Bump when the meaning or layout of the cached indices changes: old caches then miss. (3: the
# megatron-core order, its split rule and sample-index row 0, uint32/int32 dtypes.)
INDEX_VERSION = 3
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
ORDERS = {"megatron": megatron_indices, "epochs": epoch_indices}

T = TypeVar("T")


class Documents(Protocol):
    """What :class:`GPTDataset` reads: one token sequence per document."""

    sequence_lengths: np.ndarray  # (num_docs,) int32

    def __len__(self) -> int: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


# --- caching ------------------------------------------------------------------------------------

def index_key(description: dict) -> str:
    """sha256 of the canonical JSON of everything the indices depend on."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _save_atomic(path: str, write: Callable) -> None:
    # A name no other writer can hold (a pid alone repeats across the hosts sharing a cache), and
    # the data on disk before the rename: else a crash can leave the new name over empty blocks.
    tmp = f"{path}.tmp.{uuid.uuid4().hex}"
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the whole file or none of it
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def build_on_one_rank(build_fn: Callable[[], T], group=None) -> T:
    """Call ``build_fn`` on rank 0 of ``group`` first, then on the other ranks.

    For a :class:`GPTDataset` with a ``cache_dir`` on a filesystem every rank sees: rank 0
    builds and writes the cache while the others wait, then they load it instead of all
    building the same indices at once. Without torch.distributed initialised it is just
    ``build_fn()``. If rank 0 fails, every rank raises (with rank 0's error), so none is left
    waiting in a later collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return build_fn()
    result, error = None, [None]
    if dist.get_rank(group) == 0:
        try:
            result = build_fn()
        except Exception as e:  # tell the others, then raise here too
            error = [f"{type(e).__name__}: {e}"]
            dist.broadcast_object_list(error, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            raise
    dist.broadcast_object_list(error, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    if dist.get_rank(group) == 0:
        return result
    if error[0] is not None:
        raise RuntimeError(f"rank 0 failed to build what this rank needs: {error[0]}")
    return build_fn()


# --- the dataset --------------------------------------------------------------------------------

class GPTDataset:
    """Samples of ``seq_len + 1`` int64 tokens from ``docs[document_range]``, deterministic in ``seed``.

    ``num_samples``: the samples asked for (None: one epoch, as megatron-core's ``None``);
    ``len(self) >= num_samples``, every sample of the epochs needed being kept (the last epoch
    may be partly used). ``order``: ``"megatron"``, megatron-core's ``GPTDataset`` indices, or
    ``"epochs"``, each epoch shuffled apart (a longer run then sees the same first samples).
    ``built_index`` is True when this construction built the indices, False when they came from
    ``cache_dir``. ``name`` identifies the corpus (e.g. its path prefix) in the cache key, together
    with its document count and token count.
    """

    def __init__(self, docs: Documents, document_range: range, seq_len: int, num_samples: int | None,
                 seed: int, cache_dir: str | None = None, name: str = "", order: str = "megatron"):
        lengths = np.asarray(docs.sequence_lengths)
        if document_range.step != 1 or not 0 <= document_range.start <= document_range.stop <= len(lengths):
            raise ValueError(f"document_range {document_range} is not a contiguous range within "
                             f"the {len(lengths)} documents")
        if seq_len < 1 or (num_samples is not None and num_samples < 1):
            raise ValueError(f"seq_len ({seq_len}) and num_samples ({num_samples}) must be positive")
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: give one of {sorted(ORDERS)}")
        self.docs, self.seq_len, self.seed, self.range, self.order = docs, seq_len, seed, document_range, order
        self.lengths = lengths
        self.tokens_per_epoch = int(lengths[document_range.start:document_range.stop].sum(dtype=np.int64))
        if self.tokens_per_epoch < 2:
            raise ValueError(f"documents {document_range} of {name or 'the corpus'} hold "
                             f"{self.tokens_per_epoch} tokens: too few for a sample")
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, seq_len, num_samples)
        self.description = {
            "version": INDEX_VERSION, "order": order, "name": name, "num_documents": len(lengths),
            "num_tokens": int(lengths.sum(dtype=np.int64)),
            # the indices depend on the lengths themselves: a re-preprocessed corpus with the same
            # counts but other documents must not reuse them
            "lengths_sha256": hashlib.sha256(np.ascontiguousarray(
                lengths[document_range.start:document_range.stop], dtype=np.int64).tobytes()).hexdigest(),
            "range": [document_range.start, document_range.stop],
            "seq_len": seq_len, "num_samples": num_samples, "seed": seed,
        }
        self.key = index_key(self.description)
        self.cache_dir = cache_dir
        indices = self._load() if cache_dir is not None else None
        self.built_index = indices is None
        if indices is None:
            indices = ORDERS[order](lengths, document_range, seq_len, num_samples, seed)
            if cache_dir is not None:
                self._save(indices)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def _paths(self) -> dict[str, str]:
        base = os.path.join(self.cache_dir, self.key)
        paths = {n: f"{base}-{n}.npy" for n in _INDEX_NAMES}
        paths["description"] = f"{base}-description.json"
        return paths

    def _load(self):
        paths = self._paths()
        # The description is written last, so its presence means the three indices are complete.
        if not os.path.exists(paths["description"]):
            return None
        try:
            indices = tuple(np.load(paths[n], mmap_mode="r") for n in _INDEX_NAMES)
        except (OSError, ValueError, EOFError):  # a file missing or cut short: build again
            return None
        document_index, sample_index, shuffle_index = indices
        if (document_index.shape != (self.num_epochs * (self.range.stop - self.range.start),)
                or sample_index.ndim != 2 or sample_index.shape[1] != 2
                or shuffle_index.shape != (len(sample_index) - 1,)):
            return None
        return indices

    def _save(self, indices) -> None:
        os.makedirs(self.cache_dir, exist_ok=True)
        paths = self._paths()
        for n, array in zip(_INDEX_NAMES, indices):
            _save_atomic(paths[n], lambda f, a=array: np.save(f, a))
        text = json.dumps(self.description, sort_keys=True, indent=1).encode()
        _save_atomic(paths["description"], lambda f: f.write(text))

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        """``(seq_len + 1,)`` int64 tokens of the ``i``-th sample served (through the shuffle)."""
        return self.read_sample(int(self.shuffle_index[i]))

    def _span(self, j: int) -> tuple[int, int, int, int]:
        if not 0 <= j < len(self.sample_index) - 1:
            raise IndexError(f"sample {j} out of range [0, {len(self.sample_index) - 1})")
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        return int(d0), int(o0), int(d1), int(o1)

    def read_sample(self, j: int) -> np.ndarray:
        """Sample ``j`` in stream order (no shuffle): tokens ``[j * seq_len, (j + 1) * seq_len]``."""
        d0, o0, d1, o1 = self._span(j)
        ids = self.document_index
        if d0 == d1:
            return self.docs.get(int(ids[d0]), offset=o0, length=o1 - o0 + 1).astype(np.int64)
        pieces = [self.docs.get(int(ids[d0]), offset=o0)]
        pieces += [self.docs.get(int(ids[d])) for d in range(d0 + 1, d1)]
        pieces.append(self.docs.get(int(ids[d1]), offset=0, length=o1 + 1))
        return np.concatenate(pieces).astype(np.int64)

    def document_boundaries(self, i: int) -> np.ndarray:
        """Starts of the document pieces in the ``i``-th served sample, int64, ascending.

        Always ``0`` first (the sample's first piece, whether or not its document starts there),
        then every position ``< seq_len + 1`` where a new document begins. Appending
        ``seq_len + 1`` gives ``cu_seqlens`` for packed-sequence attention over the sample
        (drop starts ``>= seq_len`` when masking only the inputs ``tokens[:-1]``).
        """
        d0, o0, d1, _ = self._span(int(self.shuffle_index[i]))
        lengths = self.lengths[self.document_index[d0:d1 + 1]].astype(np.int64)
        # Position in the sample where each of documents d0+1..d1 starts.
        starts = lengths[0] - o0 + np.concatenate([[0], np.cumsum(lengths[1:-1])])
        # empty documents add nothing (nor do ones before the first token: row 0 may point at one)
        starts = starts[(lengths[1:] > 0) & (starts > 0)] if d1 > d0 else starts[:0]
        return np.concatenate([[0], starts]).astype(np.int64)
