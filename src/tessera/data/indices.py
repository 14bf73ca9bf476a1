"""A GPT dataset's document split and its three indices, by megatron-core's rules, in numpy.

megatron-core (0.16.1) builds these in ``datasets/blended_megatron_dataset_config.py`` and the
builder (the split), ``datasets/gpt_dataset.py`` (the document and shuffle indices) and
``datasets/helpers.cpp::build_sample_idx`` (the sample index, a C++ loop it compiles at run time).
Here they are numpy calls, equal to megatron-core's value for value and dtype for dtype
(tests/test_megatron_data.py builds both and compares them); nothing to compile.

- **split**: the documents ``[round(a * n), round(b * n))`` of each part, ``a, b`` the running
  sums of the normalised weights (:func:`split_documents`).
- **document index** ``(num_epochs * num_docs,)`` int32: the part's documents once per epoch, all
  epochs shuffled together by ``np.random.RandomState(seed)``, except that a last epoch less than
  80 % used is shuffled apart, after the others (:func:`megatron_indices`).
- **sample index** ``(num_samples + 1, 2)``: row ``j`` is ``(position in the document index,
  token offset)`` of stream position ``j * seq_len``, sample ``j``'s first token; row ``j + 1``
  its last one (the extra token: a sample is ``seq_len + 1`` tokens). :func:`build_sample_index`.
- **shuffle index** ``(num_samples,)``: the order samples are served in, one shuffle by the same
  generator after the document shuffle (the samples of a separate last epoch shuffled apart).

:func:`epoch_indices` is tessera's other order (``data.sample_order=epochs``): each epoch shuffled
on its own, documents and then the samples that end in it, so that asking for more samples (a
longer run, more epochs) never reorders the ones served before. In megatron-core's order the
number of epochs and the 80 % rule depend on the number of samples asked for, so a longer run
can reorder everything.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

import numpy as np

# megatron-core shuffles a last epoch apart when it is used less than this much
FINAL_EPOCH_THRESHOLD = 0.80
_INT32_MAX = np.iinfo(np.int32).max


def normalize(weights: Sequence[float]) -> list[float]:
    """megatron-core's ``normalize``: float64 weights over their numpy sum. Split boundaries and
    blend picks round these floats, so the very same arithmetic is kept (numpy's sum of
    ``[0.1, 0.2, 0.3]`` is 0.6, Python's 0.6000000000000001)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


# --- the split -----------------------------------------------------------------------------------

def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised ``[train, valid, test]`` weights (missing ones are 0).

    megatron-core reads every number in the string (``re.findall(r"[.0-9]+")``); tessera is
    stricter: comma (or slash) separated, at most three, non-negative, at least one positive.
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
    return normalize(weights + [0.0] * (3 - len(weights)))


def split_documents(num_docs: int, split: str) -> list[range]:
    """Contiguous document ranges ``[train, valid, test]`` for a ``"969,30,1"`` split string.

    megatron-core's rule: the book-ends ``a, b`` of part ``i`` are running sums of the normalised
    weights (``convert_split_vector_to_split_matrix``), and the part is documents
    ``[round(a * n), round(b * n))``, Python's ``round`` (halves to even). A zero weight gives an
    empty range (megatron-core builds no dataset for it). ``(10, "1,1,1")`` -> ``[0, 3), [3, 7),
    [7, 10)``. The ranges are disjoint and cover ``range(num_docs)``.
    """
    ends = [0.0]
    for w in parse_split(split):
        ends.append(ends[-1] + w)
    ranges = []
    for a, b in itertools.pairwise(ends):
        start = int(round(a * float(num_docs)))
        ranges.append(range(start, start if b <= a else int(round(b * float(num_docs)))))
    return ranges


# --- megatron-core's order -----------------------------------------------------------------------

def num_epochs_needed(tokens_per_epoch: int, seq_len: int, num_samples: int | None) -> int:
    """Fewest epochs whose stream holds ``num_samples`` samples of ``seq_len + 1`` tokens; one
    for ``None`` (megatron-core's "one epoch").

    ``E`` epochs hold ``(E * tokens_per_epoch - 1) // seq_len`` samples (the extra token of the
    last sample must exist), so ``E = ceil((num_samples * seq_len + 1) / tokens_per_epoch)``.
    """
    if num_samples is None:
        return 1
    return max(-(-(num_samples * seq_len + 1) // tokens_per_epoch), 1)


def samples_in(num_tokens: int, seq_len: int) -> int:
    """Samples of ``seq_len + 1`` tokens, each starting where the last ended, in ``num_tokens``."""
    return max(num_tokens - 1, 0) // seq_len


def separate_final_epoch(num_samples: int | None, tokens_per_epoch: int, seq_len: int) -> int | None:
    """Samples before the last epoch when megatron-core shuffles that epoch apart, else None.

    It does so when the run uses less than 80 % of the last epoch's samples, so that those few
    are not spread thinly over the whole run.
    """
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_len, num_samples)
    if num_epochs == 1:
        return None
    before = samples_in((num_epochs - 1) * tokens_per_epoch, seq_len)
    from_final = num_samples - before
    if from_final < int(FINAL_EPOCH_THRESHOLD * samples_in(tokens_per_epoch, seq_len)):
        return before
    return None


def random_state(seed: int) -> np.random.RandomState:
    """megatron-core's generator, ``np.random.RandomState(seed)``. A seed of 2**32 or more
    (RandomState refuses it, and so megatron-core) is given as its two 32-bit words."""
    if seed < 2**32:
        return np.random.RandomState(seed)
    return np.random.RandomState([seed & 0xFFFFFFFF, seed >> 32])


def megatron_indices(lengths: np.ndarray, document_range: range, seq_len: int,
                     num_samples: int | None, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """megatron-core's ``GPTDataset`` document, sample and shuffle indices.

    ``lengths`` are every document's lengths (the whole corpus); ``num_samples`` the samples
    asked for (None: one epoch). One generator, in megatron-core's order of draws: the document
    shuffle (of the epochs before a separate last one, then of that one), then the sample shuffle
    (likewise in two parts).
    """
    tokens_per_epoch = int(lengths[document_range.start:document_range.stop].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_len, num_samples)
    first = separate_final_epoch(num_samples, tokens_per_epoch, seq_len)
    rng = random_state(seed)
    docs = np.arange(document_range.start, document_range.stop,
                     dtype=np.int32 if document_range.stop <= _INT32_MAX else np.int64)
    if first is None:
        document_index = np.tile(docs, num_epochs)
        rng.shuffle(document_index)
    else:
        before, last = np.tile(docs, num_epochs - 1), docs.copy()
        rng.shuffle(before)
        rng.shuffle(last)
        document_index = np.concatenate([before, last])
    fits = max(len(document_index), int(lengths.max(initial=0))) <= _INT32_MAX
    sample_index = build_sample_index(lengths[document_index], seq_len, np.int32 if fits else np.int64)
    total = len(sample_index) - 1
    return document_index, sample_index, shuffle_in_two(total if first is None else first, total, rng)


def build_sample_index(doc_lengths: np.ndarray, seq_len: int, dtype=np.int64) -> np.ndarray:
    """``(num_samples + 1, 2)`` rows ``(document index position, offset)``, helpers.cpp's values.

    ``doc_lengths`` are the lengths in document-index order. Sample ``j`` starts at stream
    position ``p = j * seq_len``; its document is the last one whose start ``cum[d] <= p``
    (``side="right"`` skips empty documents), its offset ``p - cum[d]``. The stream of ``N``
    tokens holds ``(N - 1) // seq_len`` samples; the extra row locates the last one's end. Row 0
    is ``(0, 0)`` even where the first documents are empty, as helpers.cpp starts there.
    """
    cum = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=cum[1:])
    starts = np.arange(samples_in(int(cum[-1]), seq_len) + 1, dtype=np.int64) * seq_len
    doc_pos = np.searchsorted(cum, starts, side="right") - 1
    rows = np.stack([doc_pos, starts - cum[doc_pos]], axis=1)
    rows[0] = 0
    return rows.astype(dtype, copy=False)


def shuffle_in_two(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """megatron-core's shuffle index: ``[0, first)`` shuffled, then ``[first, total)`` shuffled;
    uint32, or int64 for ``total`` near 2**32."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


# --- tessera's per-epoch order -------------------------------------------------------------------

def epoch_indices(lengths: np.ndarray, document_range: range, seq_len: int,
                  num_samples: int | None, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three indices with each epoch shuffled on its own (``data.sample_order=epochs``)."""
    tokens_per_epoch = int(lengths[document_range.start:document_range.stop].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_len, num_samples)
    document_index = epoch_document_index(document_range, num_epochs, seed)
    sample_index = build_sample_index(lengths[document_index], seq_len)
    shuffle_index = epoch_shuffle_index(len(sample_index) - 1, seq_len, tokens_per_epoch, seed)
    return document_index, sample_index, shuffle_index


def epoch_document_index(document_range: range, num_epochs: int, seed: int) -> np.ndarray:
    """``(num_epochs * len(document_range),)`` document ids, epoch ``e`` shuffled by
    ``default_rng([seed, e])``, so adding epochs never reorders earlier ones."""
    docs = np.arange(document_range.start, document_range.stop, dtype=np.int64)
    dtype = np.int32 if document_range.stop <= _INT32_MAX else np.int64
    epochs = [np.random.default_rng([seed, e]).permutation(docs) for e in range(num_epochs)]
    return np.concatenate(epochs).astype(dtype)


def epoch_shuffle_index(num_samples: int, seq_len: int, tokens_per_epoch: int, seed: int) -> np.ndarray:
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
