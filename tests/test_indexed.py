"""The .bin/.idx pair: Megatron's byte layout (built here by hand, not by tessera's writer),
round trips, atomic writes, and an error naming the file for every way a pair can be broken."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from tessera.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, best_dtype

DOCS = [[5, 6, 7], [1], [300, 2, 65000, 9], [42, 43]]


def megatron_pair(prefix, docs, dtype_code=8, dtype=np.uint16):
    """Write ``prefix.bin/.idx`` byte by byte from Megatron's ``_IndexWriter`` layout: magic,
    uint64 version 1, uint8 dtype code, uint64 sequence count, uint64 len(document_indices),
    int32 lengths, int64 byte pointers, int64 document indices [0, 1, ..., S] (one sequence per
    document, as add_item + end_document writes)."""
    lengths = [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    document_indices = list(range(len(docs) + 1))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(document_indices)}q", *document_indices)
    data = b"".join(np.asarray(d, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes() for d in docs)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(data)
    return idx, data


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def test_megatron_layout_reads_back_and_writer_is_byte_identical(tmp_path):
    idx, data = megatron_pair(tmp_path / "ref", DOCS)
    ds = IndexedDataset(str(tmp_path / "ref"))
    assert len(ds) == 4 and ds.num_documents == 4 and ds.num_tokens == 10
    assert ds.dtype == np.uint16
    assert ds.sequence_lengths.dtype == np.int32 and ds.sequence_lengths.tolist() == [3, 1, 4, 2]
    assert ds.sequence_pointers.dtype == np.int64 and ds.sequence_pointers.tolist() == [0, 6, 8, 16]
    assert ds.document_indices.dtype == np.int64 and ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS

    write(tmp_path / "ours", DOCS)
    assert (tmp_path / "ours.idx").read_bytes() == idx
    assert (tmp_path / "ours.bin").read_bytes() == data


@pytest.mark.parametrize("dtype,code", [(np.uint8, 1), (np.int8, 2), (np.int16, 3), (np.int32, 4),
                                        (np.int64, 5), (np.float64, 6), (np.float32, 7), (np.uint16, 8)])
def test_every_megatron_dtype_code(tmp_path, dtype, code):
    docs = [[1, 2, 3], [4, 5], [6]]
    idx, data = megatron_pair(tmp_path / "ref", docs, code, dtype)
    ds = IndexedDataset(tmp_path / "ref")
    assert ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(3)] == docs
    write(tmp_path / "ours", docs, dtype)
    assert (tmp_path / "ours.idx").read_bytes() == idx and (tmp_path / "ours.bin").read_bytes() == data


def test_get_slices_and_bounds(tmp_path):
    write(tmp_path / "d", DOCS)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.get(2, offset=1).tolist() == [2, 65000, 9]
    assert ds.get(2, offset=1, length=2).tolist() == [2, 65000]
    assert ds.get(2, offset=4).tolist() == []
    assert ds[-1].tolist() == [42, 43]
    assert ds.document(2).tolist() == DOCS[2]
    with pytest.raises(IndexError, match="out of range"):
        ds.get(2, offset=3, length=2)
    with pytest.raises(IndexError, match="4 sequences"):
        ds[4]
    assert not ds[0].flags.writeable  # a view of the read-only map, not a copy


def test_pickle_reopens_instead_of_copying(tmp_path):
    write(tmp_path / "d", DOCS)
    ds = IndexedDataset(tmp_path / "d")
    blob = pickle.dumps(ds)
    assert len(blob) < 100 + len(str(tmp_path))  # the prefix, not the arrays
    assert [x.tolist() for x in (pickle.loads(blob)[i] for i in range(4))] == DOCS


def test_large_vocab_and_best_dtype(tmp_path):
    assert best_dtype(300) is np.uint16 and best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32 and best_dtype(128256) is np.int32
    docs = [[0, 100000, 128255], [7]]
    write(tmp_path / "d", docs, best_dtype(128256))
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.int32 and [ds[i].tolist() for i in range(2)] == docs


def test_empty_dataset(tmp_path):
    write(tmp_path / "d", [])
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
    assert os.path.getsize(tmp_path / "d.bin") == 0


# --- errors: each names the broken file ---------------------------------------------------------

def test_missing_files(tmp_path):
    write(tmp_path / "d", DOCS)
    os.remove(tmp_path / "d.idx")
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: not found"):
        IndexedDataset(tmp_path / "d")
    write(tmp_path / "e", DOCS)
    os.remove(tmp_path / "e.bin")
    with pytest.raises(IndexedDatasetError, match=r"e\.bin: not found"):
        IndexedDataset(tmp_path / "e")
    with pytest.raises(IndexedDatasetError, match=r"nothing\.idx and .*nothing\.bin: not found"):
        IndexedDataset(tmp_path / "nothing")


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_magic(tmp_path):
    megatron_pair(tmp_path / "d", DOCS)
    _patch(tmp_path / "d.idx", 0, b"X")
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: not a Megatron index: bad magic"):
        IndexedDataset(tmp_path / "d")


def test_bad_version(tmp_path):
    megatron_pair(tmp_path / "d", DOCS)
    _patch(tmp_path / "d.idx", 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: unsupported index version 2"):
        IndexedDataset(tmp_path / "d")


def test_unknown_dtype_code(tmp_path):
    megatron_pair(tmp_path / "d", DOCS)
    _patch(tmp_path / "d.idx", 17, struct.pack("<B", 9))
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: unknown dtype code 9"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("keep", [5, 20, 40, -1])
def test_truncated_idx(tmp_path, keep):
    megatron_pair(tmp_path / "d", DOCS)
    path = tmp_path / "d.idx"
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: .*truncated"):
        IndexedDataset(tmp_path / "d")


def test_idx_with_trailing_bytes(tmp_path):
    megatron_pair(tmp_path / "d", DOCS)
    with open(tmp_path / "d.idx", "ab") as f:
        f.write(b"\0" * 3)
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: .*trailing bytes"):
        IndexedDataset(tmp_path / "d")


def test_truncated_or_long_bin(tmp_path):
    megatron_pair(tmp_path / "d", DOCS)
    path = tmp_path / "d.bin"
    full = path.read_bytes()
    path.write_bytes(full[:-1])
    with pytest.raises(IndexedDatasetError, match=r"d\.bin: 19 bytes, .* 10 tokens of uint16 = 20 bytes \(truncated"):
        IndexedDataset(tmp_path / "d")
    path.write_bytes(full + b"\0\0")
    with pytest.raises(IndexedDatasetError, match=r"d\.bin: 22 bytes.*too long"):
        IndexedDataset(tmp_path / "d")


def test_corrupt_document_index(tmp_path):
    megatron_pair(tmp_path / "d", DOCS)
    size = os.path.getsize(tmp_path / "d.idx")
    _patch(tmp_path / "d.idx", size - 8, struct.pack("<q", 3))  # last entry should be 4
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: corrupt document index"):
        IndexedDataset(tmp_path / "d")


HEADER = 34  # magic 9, version 8, dtype 1, two counts 8 + 8


@pytest.mark.parametrize("chunk", [1, 3, 1 << 22])
def test_a_sequence_pointer_off_its_place_is_refused(tmp_path, monkeypatch, chunk):
    """Sequence 2 should start at byte 8 (3 + 1 tokens of 2 bytes before it): read at 10, it
    would return its own tail and the next sequence's head, silently."""
    import tessera.data.indexed as indexed

    monkeypatch.setattr(indexed, "_CHECK_CHUNK", chunk)  # the check in chunks, boundaries included
    megatron_pair(tmp_path / "d", DOCS)
    assert IndexedDataset(tmp_path / "d").get(2).tolist() == DOCS[2]
    _patch(tmp_path / "d.idx", HEADER + 4 * len(DOCS) + 8 * 2, struct.pack("<q", 10))
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: corrupt: sequence 2 starts at byte 10, but the "
                                                  r"lengths before it end at byte 8"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("chunk", [1, 2, 1 << 22])
def test_a_document_index_going_back_is_refused(tmp_path, monkeypatch, chunk):
    import tessera.data.indexed as indexed

    monkeypatch.setattr(indexed, "_CHECK_CHUNK", chunk)
    megatron_pair(tmp_path / "d", DOCS)
    _patch(tmp_path / "d.idx", HEADER + 12 * len(DOCS) + 8 * 2, struct.pack("<q", 0))  # [0, 1, 0, 3, 4]
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: corrupt document index: document 1 ends at sequence 0, "
                                                  r"before it starts \(1\)"):
        IndexedDataset(tmp_path / "d")


def test_writer_refuses_empty_document_by_number(tmp_path):
    with (pytest.raises(IndexedDatasetError, match=r"d\.bin.*document 2 \(0-based\) is empty"),
          IndexedDatasetWriter(tmp_path / "d", np.uint16) as w):
        w.add_document([1, 2])
        w.add_document([3])
        w.add_document([])
    assert not IndexedDataset.exists(tmp_path / "d")
    assert os.listdir(tmp_path) == []  # the temporaries are gone too


@pytest.mark.parametrize("dtype,token", [(np.uint16, 65536), (np.uint16, -1), (np.int32, 2**31), (np.uint8, 256)])
def test_writer_refuses_out_of_range_ids(tmp_path, dtype, token):
    with IndexedDatasetWriter(tmp_path / "d", dtype) as w:
        w.add_document([1])
        with pytest.raises(IndexedDatasetError, match=rf"d\.bin.*document 1 \(0-based\): token id {token} is out of range"):
            w.add_document([2, token])
    assert [x.tolist() for x in IndexedDataset(tmp_path / "d")] == [[1]]  # the refused one was not written


def test_writer_refuses_unsupported_dtype(tmp_path):
    with pytest.raises(IndexedDatasetError, match="uint32 has no Megatron code"):
        IndexedDatasetWriter(tmp_path / "d", np.uint32)


def test_crash_before_close_leaves_no_pair(tmp_path):
    write(tmp_path / "d", [[1, 2], [3]])
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        w.add_document([9, 9, 9])
        raise RuntimeError("killed mid-write")
    # The old pair survives untouched and no temporary is left behind.
    assert [x.tolist() for x in IndexedDataset(tmp_path / "d")] == [[1, 2], [3]]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]

    # A process that dies without any cleanup leaves only temporaries, never a readable pair.
    w = IndexedDatasetWriter(tmp_path / "new", np.uint16)
    w.add_document([1, 2, 3])
    w._bin.flush()
    assert not IndexedDataset.exists(tmp_path / "new")
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(tmp_path / "new")
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_overwrite_replaces_pair(tmp_path):
    write(tmp_path / "d", [[1, 2], [3]])
    write(tmp_path / "d", [[7]])
    ds = IndexedDataset(tmp_path / "d")
    assert [x.tolist() for x in ds] == [[7]]


def test_two_writers_of_one_prefix_keep_their_own_temporaries(tmp_path):
    # Two writers in one process (or on two hosts with the same pid) must not share temporary
    # names: the second would truncate the first's tokens, and its abort would delete them.
    first = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    first.add_document([1, 2, 3])
    second = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    second.add_document([9])
    second.abort()
    first.close()
    assert [x.tolist() for x in IndexedDataset(tmp_path / "d")] == [[1, 2, 3]]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
