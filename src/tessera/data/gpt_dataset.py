"""Documents to GPT training samples: Megatron's three indices, built with numpy and cached.

A GPT sample is ``seq_len + 1`` consecutive tokens of one long stream made by concatenating the
split's documents (inputs are ``tokens[:-1]``, labels ``tokens[1:]``). Consecutive samples share
one token: sample ``j`` covers stream positions ``[j * seq_len, (j + 1) * seq_len]``, so every
token is a label exactly once per epoch. Three indices describe the stream, as in Megatron's
``GPTDataset``:

- **document index** ``(num_epochs * num_docs,)`` int32: document ids in stream order, the
  split's documents once per epoch, each epoch in its own seeded order.
- **sample index** ``(num_samples + 1, 2)`` int64: row ``j`` is ``(position in the document
  index, token offset in that document)`` of sample ``j``'s first token; row ``j + 1`` locates
  its last token. Megatron builds this with a C++ loop (``helpers.cpp::build_sample_idx``); here
  it is one ``np.cumsum`` over document lengths and one ``np.searchsorted`` of the sample starts.
- **shuffle index** ``(num_samples,)`` int64: the order in which samples are served.

Where tessera differs from Megatron, and why: Megatron shuffles the document index of all epochs
together and, when the last epoch is less than 80 % used, shuffles that epoch apart. tessera
shuffles each epoch on its own (documents, then the samples that end in it), so epoch ``e`` is
finished before any sample of epoch ``e + 1`` is served, with no threshold to tune, and a longer
run (more samples, more epochs) serves the same samples first.

The indices are cached as ``.npy`` files under a sha256 key of everything they depend on; with
several ranks, :func:`build_on_one_rank` lets rank 0 build while the others wait, then load.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import uuid
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np

# Bump when the meaning or layout of the cached indices changes: old caches then miss.
INDEX_VERSION = 2
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")

T = TypeVar("T")


class Documents(Protocol):
    """What :class:`GPTDataset` reads: one token sequence per document."""

    sequence_lengths: np.ndarray  # (num_docs,) int32

    def __len__(self) -> int: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


# --- splits -------------------------------------------------------------------------------------

def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised ``[train, valid, test]`` weights (missing ones are 0).

    Megatron reads every number in the string (``re.findall(r"[.0-9]+")``); tessera is stricter:
    comma (or slash) separated, at most three, non-negative, at least one positive.
    """
    parts = [p.strip() for p in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"split {split!r}: give 1 to 3 comma-separated weights, e.g. '969,30,1'")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {split!r}: every weight must be a number, e.g. '969,30,1'") from None
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r}: weights must be non-negative with at least one positive")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_documents(num_docs: int, split: str) -> list[range]:
    """Contiguous document ranges ``[train, valid, test]`` for a ``"969,30,1"`` split string.

    Megatron's rounding rule (``_get_split_indices``): each boundary is the running sum of
    ``round(weight * num_docs)``, then all boundaries after the first are shifted by the same
    amount so that the last one is exactly ``num_docs``. The ranges are disjoint and cover
    ``range(num_docs)``; a zero weight gives an empty range. (tessera also clips the shifted
    boundaries into ``[0, num_docs]``, which Megatron's rule can leave only for tiny corpora.)
    """
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_docs))))
    excess = bounds[-1] - num_docs
    bounds = [0] + [min(max(b - excess, 0), num_docs) for b in bounds[1:]]
    bounds = list(np.maximum.accumulate(bounds))
    return [range(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


# --- the three indices --------------------------------------------------------------------------

def num_epochs_needed(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Fewest epochs whose stream holds ``num_samples`` samples of ``seq_len + 1`` tokens.

    ``E`` epochs hold ``(E * tokens_per_epoch - 1) // seq_len`` samples (the extra token of the
    last sample must exist), so ``E = ceil((num_samples * seq_len + 1) / tokens_per_epoch)``.
    """
    return -(-(num_samples * seq_len + 1) // tokens_per_epoch)


def build_document_index(document_range: range, num_epochs: int, seed: int) -> np.ndarray:
    """``(num_epochs * len(document_range),)`` int32 document ids, each epoch its own shuffle.

    Epoch ``e`` uses ``default_rng([seed, e])``, so adding epochs never reorders earlier ones.
    """
    docs = np.arange(document_range.start, document_range.stop, dtype=np.int64)
    dtype = np.int32 if document_range.stop <= np.iinfo(np.int32).max else np.int64
    epochs = [np.random.default_rng([seed, e]).permutation(docs) for e in range(num_epochs)]
    return np.concatenate(epochs).astype(dtype)


def build_sample_index(doc_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """``(num_samples + 1, 2)`` int64 rows ``(document index position, offset)``.

    ``doc_lengths`` are the lengths in document-index order. Sample ``j`` starts at stream
    position ``p = j * seq_len``; its document is the last one whose start ``cum[d] <= p``
    (``side="right"`` skips empty documents), its offset ``p - cum[d]``. The stream of ``N``
    tokens holds ``(N - 1) // seq_len`` samples; the extra row locates the last one's end.
    """
    cum = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=cum[1:])
    num_samples = (int(cum[-1]) - 1) // seq_len
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    doc_pos = np.searchsorted(cum, starts, side="right") - 1
    return np.stack([doc_pos, starts - cum[doc_pos]], axis=1)


def build_shuffle_index(num_samples: int, seq_len: int, tokens_per_epoch: int, seed: int) -> np.ndarray:
    """``(num_samples,)`` int64: the samples of each epoch (by their last token) permuted.

    Sample starts grow with ``j``, so each epoch's samples are one contiguous block; the blocks
    stay in epoch order and each is shuffled with ``default_rng([seed, epoch, 1])``.
    """
    T, s = tokens_per_epoch, seq_len
    blocks = []
    for e in range(-(-(num_samples * s + 1) // T)):
        # Epoch e's block: the samples whose LAST token lies in epoch e, j in
        # [ceil(e T / s) - 1, ceil((e + 1) T / s) - 1). A block is complete as soon as its epoch is
        # built, so asking for more samples later (a longer run, another epoch) never reorders the
        # samples already served.
        a, b = max(-(-e * T // s) - 1, 0), -(-(e + 1) * T // s) - 1
        if a >= num_samples:
            break
        block = a + np.random.default_rng([seed, e, 1]).permutation(b - a)
        blocks.append(block[block < num_samples])
    return np.concatenate(blocks).astype(np.int64) if blocks else np.zeros(0, dtype=np.int64)


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

    ``len(self) >= num_samples``: every sample of the epochs needed is kept (the last epoch may be
    partly used), so a longer run with the same seed sees the same first samples.
    ``built_index`` is True when this construction built the indices, False when they came from
    ``cache_dir``. ``name`` identifies the corpus (e.g. its path prefix) in the cache key, together
    with its document count and token count.
    """

    def __init__(self, docs: Documents, document_range: range, seq_len: int, num_samples: int,
                 seed: int, cache_dir: str | None = None, name: str = ""):
        lengths = np.asarray(docs.sequence_lengths)
        if document_range.step != 1 or not 0 <= document_range.start <= document_range.stop <= len(lengths):
            raise ValueError(f"document_range {document_range} is not a contiguous range within "
                             f"the {len(lengths)} documents")
        if seq_len < 1 or num_samples < 1:
            raise ValueError(f"seq_len ({seq_len}) and num_samples ({num_samples}) must be positive")
        self.docs, self.seq_len, self.seed, self.range = docs, seq_len, seed, document_range
        self.lengths = lengths
        self.tokens_per_epoch = int(lengths[document_range.start:document_range.stop].sum(dtype=np.int64))
        if self.tokens_per_epoch < 2:
            raise ValueError(f"documents {document_range} of {name or 'the corpus'} hold "
                             f"{self.tokens_per_epoch} tokens: too few for a sample")
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, seq_len, num_samples)
        self.description = {
            "version": INDEX_VERSION, "name": name, "num_documents": len(lengths),
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
            indices = self._build(document_range)
            if cache_dir is not None:
                self._save(indices)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def _build(self, document_range: range) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        document_index = build_document_index(document_range, self.num_epochs, self.seed)
        sample_index = build_sample_index(self.lengths[document_index], self.seq_len)
        shuffle_index = build_shuffle_index(len(sample_index) - 1, self.seq_len,
                                            self.tokens_per_epoch, self.seed)
        return document_index, sample_index, shuffle_index

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
        starts = starts[lengths[1:] > 0] if d1 > d0 else starts[:0]  # empty documents add nothing
        return np.concatenate([[0], starts]).astype(np.int64)
