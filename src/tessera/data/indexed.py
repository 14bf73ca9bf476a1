"""Megatron's indexed dataset: token ids in a ``.bin`` file, their layout in an ``.idx`` file.

The pair is Megatron-Core's ``MMIDIDX`` format (``megatron/core/datasets/indexed_dataset.py``), so
files written here train Megatron and files written by Megatron's ``preprocess_data.py`` train
tessera. All integers are little-endian.

``PREFIX.idx``::

    offset  size     field
    0       9        magic b"MMIDIDX\\x00\\x00"
    9       8        uint64 version, always 1
    17      1        uint8 dtype code of the tokens (DTYPE_CODES below)
    18      8        uint64 S, the number of sequences
    26      8        uint64 D + 1, the number of entries of the document index (D documents)
    34      4 S      int32 sequence lengths, in tokens
    34+4S   8 S      int64 sequence pointers: byte offset of each sequence in the .bin
    34+12S  8 (D+1)  int64 document indices: document d is sequences [idx[d], idx[d+1]); idx[0] = 0

``PREFIX.bin`` is the sequences' tokens back to back, nothing else.

Note the header's second count is the length of the document index (documents + 1), not the
number of documents: Megatron writes ``len(document_indices)`` there, and a byte-identical file
has to as well. (Megatron's multimodal variant appends S int8 "modes"; tessera does not read it.)

Both files are read through memory maps: opening a dataset of any size costs the index checks
only, and each sequence read is a zero-copy view into the page cache, shared by every data-loader
worker on the machine.
"""

from __future__ import annotations

import array
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from tessera.data import remote

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, version, dtype code, sequence count, document-index length: 34 bytes, no padding.
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's ``DType`` enum: the code stored in the header for each token dtype.
# Little-endian like the rest of the format (on the usual little-endian hosts these are simply
# np.uint8, np.int32, ...).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair that cannot be read or written; the message names the file."""


def best_dtype(vocab_size: int | None) -> type[np.number]:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65,500 ids, else int32.

    The 65,500 (not 65,536) threshold is Megatron's; keeping it means a vocabulary picks the same
    dtype in both projects, so their files stay byte-identical.
    """
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(path_prefix: str | os.PathLike) -> str:
    return os.fspath(path_prefix) + ".idx"


def bin_path(path_prefix: str | os.PathLike) -> str:
    return os.fspath(path_prefix) + ".bin"


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` + ``PREFIX.idx``.

    Everything that can be checked without reading the tokens is checked on opening, so a torn
    or mismatched pair fails here, with the file named, rather than as garbage tokens mid-run:
    both files present, magic, version, dtype code, the .idx size against its own counts, the
    .bin size against the sum of the sequence lengths, every sequence pointer against the
    lengths before it (sequences lie back to back, as every writer lays them), and the document
    index running from 0 to the sequence count without going back. (A pass over the index in
    chunks: ~2 s per hundred million documents on one core, in bounded memory.)

    Pickling carries only the prefix (data-loader workers reopen the maps instead of copying
    the arrays).

    A prefix that is a URL (``s3://bucket/corpus``) reads an object store (data/remote.py): the
    .idx copied once into ``cache_dir``, the .bin by ranged reads through a local block cache.
    """

    def __init__(self, path_prefix: str | os.PathLike, cache_dir: str = ""):
        self.path_prefix, self.cache_dir = os.fspath(path_prefix), cache_dir
        self._open()

    def _open(self) -> None:
        idx, bin_ = idx_path(self.path_prefix), bin_path(self.path_prefix)
        url = remote.is_url(self.path_prefix)
        missing = [p for p in (idx, bin_) if not (remote.exists(p) if url else os.path.isfile(p))]
        if missing:
            raise IndexedDatasetError(
                f"{' and '.join(missing)}: not found (an indexed dataset needs both "
                f"{os.path.basename(idx)} and {os.path.basename(bin_)})")
        local_idx = remote.local_copy(idx, self.cache_dir) if url else idx
        self.dtype, sequences, index_entries = _read_header(local_idx, idx)
        self._index = _map(local_idx)
        # Plain read-only ndarrays over the map (np.frombuffer, as Megatron): no copy, and
        # reductions return numbers rather than 0-d memmaps.
        at = _HEADER.size
        self.sequence_lengths: np.ndarray = np.frombuffer(self._index, "<i4", sequences, at)
        at += self.sequence_lengths.nbytes
        self.sequence_pointers: np.ndarray = np.frombuffer(self._index, "<i8", sequences, at)
        at += self.sequence_pointers.nbytes
        self.document_indices: np.ndarray = np.frombuffer(self._index, "<i8", index_entries, at)
        doc = self.document_indices
        if doc[0] != 0 or doc[-1] != sequences:
            raise IndexedDatasetError(
                f"{idx}: corrupt document index: it runs from {doc[0]} to {doc[-1]}, "
                f"expected 0 to the sequence count {sequences}")
        if sequences and self.sequence_lengths.min() < 0:
            raise IndexedDatasetError(f"{idx}: corrupt: negative sequence length")
        self._num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        expected = self._num_tokens * self.dtype.itemsize
        actual = remote.size(bin_) if url else os.path.getsize(bin_)
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_}: {actual} bytes, but {idx} describes {self._num_tokens} tokens of "
                f"{self.dtype} = {expected} bytes ({'truncated' if actual < expected else 'too long'}, "
                "or the two files are from different runs)")
        _check_layout(idx, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                      self.dtype.itemsize)
        # An empty .bin cannot be memory-mapped; a dataset of empty sequences reads from nothing.
        self._data = (remote.RangedFile(bin_, self.cache_dir) if url else _map(bin_)) if expected \
            else np.empty(0, np.uint8)

    def __len__(self) -> int:
        """The number of sequences (one per document for files tessera writes)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (to its end if ``length`` is None).

        Returns a read-only view into the memory map: no copy, and nothing read from disk until
        the caller touches it. Copy it (``np.array(...)``) to modify or keep it past the dataset.
        """
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range: {self.path_prefix} has {n} sequences")
        idx %= n
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range of sequence {idx} "
                             f"({size} tokens) in {self.path_prefix}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if isinstance(self._data, remote.RangedFile):
            return np.frombuffer(self._data.read(start, length * self.dtype.itemsize), dtype=self.dtype)
        return np.frombuffer(self._data, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated; a view when it has one)."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} out of range: {self.path_prefix} has {self.num_documents} documents")
        first, last = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if last - first == 1:
            return self.get(first)
        return np.concatenate([self.get(i) for i in range(first, last)] or [np.empty(0, self.dtype)])

    @staticmethod
    def exists(path_prefix: str | os.PathLike) -> bool:
        if remote.is_url(path_prefix):
            return remote.exists(idx_path(path_prefix)) and remote.exists(bin_path(path_prefix))
        return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "cache_dir": self.cache_dir}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix, self.cache_dir = state["path_prefix"], state.get("cache_dir", "")
        self._open()

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}: {self.num_documents} documents, {len(self)} sequences, "
                f"{self.num_tokens} tokens of {self.dtype})")


_CHECK_CHUNK = 1 << 22  # index entries per step of the layout check (bounded temporaries)


def _sampled_documents(ds: IndexedDataset, samples: int):
    """Up to ``samples`` of ``ds``'s documents, spread evenly over it."""
    n = ds.num_documents
    picks = sorted({int(i) for i in np.linspace(0, n - 1, min(n, samples))}) if n else []
    return (ds.document(i) for i in picks)


def document_ends(ds: IndexedDataset, samples: int = 1000) -> set[int]:
    """The last token ids of up to ``samples`` documents spread over ``ds``: one id where the
    preprocessing appended an end-of-document token (``tessera preprocess`` does)."""
    return {int(doc[-1]) for doc in _sampled_documents(ds, samples) if len(doc)}


def token_occurs(ds: IndexedDataset, token: int, samples: int = 1000) -> bool:
    """Whether ``token`` occurs anywhere in the documents :func:`document_ends` samples (data
    stored as fixed-length rows of packed documents holds its end-of-document ids inside rows)."""
    return any(bool((doc == token).any()) for doc in _sampled_documents(ds, samples))


def _check_layout(idx: str, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray,
                  itemsize: int) -> None:
    """Sequences back to back from byte 0 (pointer i = the bytes of sequences before i), and
    document boundaries non-decreasing: else a read would return another sequence's tokens, or
    bytes past the file, without an error."""
    end = 0  # bytes of the sequences before this chunk
    for at in range(0, len(lengths), _CHECK_CHUNK):
        chunk = lengths[at:at + _CHECK_CHUNK].astype(np.int64) * itemsize
        starts = np.cumsum(chunk) - chunk + end
        wrong = np.flatnonzero(pointers[at:at + _CHECK_CHUNK] != starts)
        if len(wrong):
            i = at + int(wrong[0])
            raise IndexedDatasetError(f"{idx}: corrupt: sequence {i} starts at byte {int(pointers[i])}, but the "
                                      f"lengths before it end at byte {int(starts[wrong[0]])}")
        end = int(starts[-1] + chunk[-1])
    for at in range(0, len(documents) - 1, _CHECK_CHUNK):
        steps = np.diff(documents[at:at + _CHECK_CHUNK + 1])
        back = np.flatnonzero(steps < 0)
        if len(back):
            d = at + int(back[0])
            raise IndexedDatasetError(f"{idx}: corrupt document index: document {d} ends at sequence "
                                      f"{int(documents[d + 1])}, before it starts ({int(documents[d])})")


def _map(path: str) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


def _read_header(path: str, idx: str) -> tuple[np.dtype, int, int]:
    """Check the fixed header and that the file is exactly as long as its counts say (``path``:
    the file read, ``idx``: its name in messages, where a store's copy is read)."""
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if not raw[:len(MAGIC)] == MAGIC and not (len(raw) < len(MAGIC) and MAGIC.startswith(raw)):
        raise IndexedDatasetError(f"{idx}: not a Megatron index: bad magic {raw[:len(MAGIC)]!r}, expected {MAGIC!r}")
    if len(raw) < _HEADER.size:
        raise IndexedDatasetError(f"{idx}: truncated: {len(raw)} bytes, shorter than the {_HEADER.size}-byte header")
    _, version, code, sequences, index_entries = _HEADER.unpack(raw)
    if version != VERSION:
        raise IndexedDatasetError(f"{idx}: unsupported index version {version} (only {VERSION} exists)")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{idx}: unknown dtype code {code} (known: "
                                  + ", ".join(f"{c} {d}" for c, d in DTYPE_CODES.items()) + ")")
    if index_entries < 1:
        raise IndexedDatasetError(f"{idx}: corrupt: document index has {index_entries} entries (at least 1, the leading 0)")
    expected = _HEADER.size + 12 * sequences + 8 * index_entries
    actual = os.path.getsize(path)
    if actual == expected + sequences and sequences:
        raise IndexedDatasetError(f"{idx}: a multimodal index (per-sequence modes), which tessera does not read")
    if actual != expected:
        raise IndexedDatasetError(
            f"{idx}: {actual} bytes, but its header counts {sequences} sequences and {index_entries - 1} "
            f"documents, which take {expected} bytes ({'truncated' if actual < expected else 'trailing bytes'})")
    return DTYPE_CODES[code], sequences, index_entries


class IndexedDatasetWriter:
    """Write ``PREFIX.bin`` + ``PREFIX.idx``, one sequence per document, byte-identical to Megatron.

    The same files Megatron's ``IndexedDatasetBuilder`` writes for ``add_item(doc)`` followed by
    ``end_document()`` per document. Writing is atomic as a pair: tokens go to a temporary
    ``PREFIX.bin.tmp-<uuid>``, the index to ``PREFIX.idx.tmp-<uuid>`` (a name no other writer holds:
    a pid repeats across the hosts sharing a file system, and within one process); only after both are complete
    and fsynced does ``close()`` remove any old ``PREFIX.idx``, rename the .bin into place and
    rename the .idx last. A crash at any point leaves either no pair, the old pair, or a .bin
    without its .idx, and the reader refuses all but the first two. Leaving the ``with`` block
    by an exception (or calling :meth:`abort`) deletes the temporaries.

    Sequence lengths are kept in a compact ``array('i')`` (4 bytes per document), so writing a
    corpus of a hundred million documents needs a few hundred MB, not a Python list of ints.
    """

    def __init__(self, path_prefix: str | os.PathLike, dtype):
        self.path_prefix = os.fspath(path_prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype not in _CODE_OF:
            raise IndexedDatasetError(f"{idx_path(self.path_prefix)}: dtype {self.dtype} has no Megatron code "
                                      f"(supported: {', '.join(str(d) for d in _CODE_OF)})")
        Path(self.path_prefix).parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{uuid.uuid4().hex}"
        self._tmp_bin = bin_path(self.path_prefix) + suffix
        self._tmp_idx = idx_path(self.path_prefix) + suffix
        self._bin = open(self._tmp_bin, "xb", buffering=1 << 20)
        self._lengths = array.array("i")
        self._closed = False
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def add_document(self, tokens) -> None:
        """Append one document (one sequence). Empty documents and out-of-range ids are refused."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise IndexedDatasetError(f"{self._tmp_bin}: document {self.num_documents}: expected a 1-D list of "
                                      f"token ids, got shape {tokens.shape}")
        self.add_documents(tokens, [len(tokens)])

    def add_documents(self, tokens, lengths) -> None:
        """Append several documents at once: ``tokens`` concatenated, ``lengths[i]`` tokens each.

        The same as ``add_document`` per document, with one range check and one write for all,
        which is what keeps the preprocessing loop off the Python-per-document path.
        """
        if self._closed:
            raise IndexedDatasetError(f"{self.path_prefix}: writer already closed")
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if len(lengths) and lengths.min() <= 0:
            bad = int(np.argmin(lengths))
            raise IndexedDatasetError(f"{self._tmp_bin}: document {self.num_documents + bad} (0-based) is empty "
                                      f"({lengths[bad]} tokens); Megatron's samplers assume every document "
                                      "has at least one token")
        if int(lengths.sum()) != len(tokens):
            raise IndexedDatasetError(f"{self._tmp_bin}: lengths add up to {int(lengths.sum())}, "
                                      f"but {len(tokens)} tokens were given")
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise IndexedDatasetError(f"{self._tmp_bin}: a document of {lengths.max()} tokens does not fit "
                                      "the index's int32 lengths")
        self._check_range(tokens, lengths)
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths.astype(np.int32).tolist())

    def _check_range(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if self._range is None or not len(tokens):
            return
        if tokens.dtype.kind not in "iub":
            raise IndexedDatasetError(f"{self._tmp_bin}: token ids must be integers for {self.dtype}, got {tokens.dtype}")
        lo, hi = self._range
        bad = np.flatnonzero((tokens < lo) | (tokens > hi))
        if len(bad):
            doc = self.num_documents + int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
            raise IndexedDatasetError(f"{self._tmp_bin}: document {doc} (0-based): token id {tokens[bad[0]]} "
                                      f"is out of range of {self.dtype} [{lo}, {hi}]")

    def close(self) -> None:
        """Finish both files and move them into place, .bin first and .idx last (see class doc)."""
        if self._closed:
            return
        self._closed = True
        try:
            _fsync_close(self._bin)
            lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.empty(0, np.int32)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            # One sequence per document, so document d is sequence d: indices 0, 1, ..., S.
            documents = np.arange(len(lengths) + 1, dtype=np.int64)
            with open(self._tmp_idx, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(documents)))
                f.write(lengths.astype("<i4", copy=False).tobytes())
                f.write(pointers.astype("<i8", copy=False).tobytes())
                f.write(documents.astype("<i8", copy=False).tobytes())
                f.flush()
                os.fsync(f.fileno())
            final_idx = idx_path(self.path_prefix)
            if os.path.exists(final_idx):  # never pair the new .bin with an old .idx, even briefly
                os.remove(final_idx)
            os.replace(self._tmp_bin, bin_path(self.path_prefix))
            os.replace(self._tmp_idx, final_idx)
        except BaseException:
            self._remove_temporaries()
            raise

    def abort(self) -> None:
        """Drop everything written so far; an existing pair at the prefix is left untouched."""
        if not self._closed:
            self._closed = True
            self._bin.close()
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _fsync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()
