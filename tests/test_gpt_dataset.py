"""GPT samples from documents: the three indices, caching, splits and blending, on a fake corpus."""

import os

import numpy as np
import pytest

from tessera.data.blend import BlendedDataset, blend_indices, parse_blend
from tessera.data.gpt_dataset import GPTDataset, build_on_one_rank, split_documents
from tessera.testing import run_ranks


class FakeDocs:
    """In-memory corpus: document ``i`` is ``length_i`` tokens ``1000 * i + 0, 1, 2, ...``, so a
    token says which document and offset it came from."""

    def __init__(self, lengths):
        self.sequence_lengths = np.asarray(lengths, dtype=np.int32)

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, idx, offset=0, length=None):
        n = int(self.sequence_lengths[idx])
        stop = n if length is None else offset + length
        assert 0 <= offset <= stop <= n, (idx, offset, length, n)
        return np.arange(offset, stop, dtype=np.int32) + 1000 * idx


def random_docs(num_docs=50, seed=0, empty=True):
    lengths = np.random.default_rng(seed).integers(1, 40, num_docs)
    if empty:
        lengths[[3, 17]] = 0  # empty documents must be skipped, not break the indices
    return FakeDocs(lengths)


def epoch_stream(ds, docs, epoch):
    ids = ds.document_index[epoch * len(docs):(epoch + 1) * len(docs)]
    return np.concatenate([docs.get(int(d)) for d in ids])


def test_samples_tile_the_epoch_stream_with_one_token_overlap():
    docs = random_docs()
    seq_len = 7
    ds = GPTDataset(docs, range(len(docs)), seq_len, num_samples=10, seed=1)
    assert ds.num_epochs == 1 and len(ds) >= 10
    stream = epoch_stream(ds, docs, 0)
    assert len(ds) == (len(stream) - 1) // seq_len
    samples = [ds.read_sample(j) for j in range(len(ds))]
    assert all(s.dtype == np.int64 and s.shape == (seq_len + 1,) for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]
    # Samples minus their overlaps are exactly the stream: nothing repeated, nothing skipped.
    joined = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])
    np.testing.assert_array_equal(joined, stream[:len(joined)])
    assert len(stream) - len(joined) < seq_len
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))


def test_same_seed_same_samples_other_seed_other_order():
    docs = random_docs()
    a, b = (GPTDataset(docs, range(len(docs)), 8, 20, seed=3) for _ in range(2))
    c = GPTDataset(docs, range(len(docs)), 8, 20, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_multi_epoch_each_epoch_a_full_shuffled_pass():
    """order="epochs" (data.sample_order=epochs): epoch by epoch, documents and samples."""
    docs = random_docs(num_docs=20)
    tokens = int(docs.sequence_lengths.sum())
    seq_len = 5
    num_samples = (3 * tokens) // seq_len + 1  # needs a fourth, partial epoch
    ds = GPTDataset(docs, range(len(docs)), seq_len, num_samples, seed=0, order="epochs")
    assert ds.num_epochs == 4 and len(ds) >= num_samples
    blocks = ds.document_index.reshape(4, len(docs))
    for block in blocks:
        assert sorted(block.tolist()) == list(range(len(docs)))
    assert len({tuple(b) for b in blocks}) == 4  # each epoch its own order
    # The stream spans epochs; every sample still reads the right tokens.
    stream = np.concatenate([epoch_stream(ds, docs, e) for e in range(4)])
    for j in range(len(ds)):
        np.testing.assert_array_equal(ds.read_sample(j), stream[j * seq_len:(j + 1) * seq_len + 1])
    # Samples of epoch e (by last token) are all served before any of epoch e + 1.
    epoch_of = (np.arange(len(ds)) + 1) * seq_len // tokens
    assert np.all(np.diff(epoch_of[ds.shuffle_index]) >= 0)


def test_multi_epoch_in_megatrons_order():
    """The default order: every document once per epoch, the epochs' documents shuffled together
    (the last one apart when under 80 % used), every sample read from the stream they make."""
    docs = random_docs(num_docs=20)
    tokens, seq_len = int(docs.sequence_lengths.sum()), 5
    for extra in (1, (tokens // seq_len) * 9 // 10):  # a fourth epoch barely used, then mostly used
        ds = GPTDataset(docs, range(len(docs)), seq_len, (3 * tokens) // seq_len + extra, seed=0)
        assert ds.num_epochs == 4
        assert np.array_equal(np.bincount(ds.document_index, minlength=20), np.full(20, 4))
        last_apart = sorted(ds.document_index[60:].tolist()) == list(range(20))
        assert last_apart == (extra == 1)
        stream = np.concatenate([docs.get(int(d)) for d in ds.document_index])
        for j in range(len(ds)):
            np.testing.assert_array_equal(ds.read_sample(j), stream[j * seq_len:(j + 1) * seq_len + 1])


def test_document_boundaries_hand_made():
    # Documents 0..3 of lengths 3, 0, 4, 6 in a fixed order: stream a a a | c c c c | d d d d d d
    docs = FakeDocs([3, 0, 4, 6])
    ds = GPTDataset(docs, range(4), seq_len=4, num_samples=3, seed=0)
    ds.document_index = np.array([0, 1, 2, 3], dtype=np.int32)
    from tessera.data.gpt_dataset import build_sample_index
    ds.sample_index = build_sample_index(docs.sequence_lengths[ds.document_index], 4)
    ds.shuffle_index = np.arange(len(ds.sample_index) - 1)
    assert len(ds) == 3  # 13 tokens -> (13 - 1) // 4 samples
    np.testing.assert_array_equal(ds[0], [0, 1, 2, 2000, 2001])
    np.testing.assert_array_equal(ds.document_boundaries(0), [0, 3])
    np.testing.assert_array_equal(ds[1], [2001, 2002, 2003, 3000, 3001])
    np.testing.assert_array_equal(ds.document_boundaries(1), [0, 3])
    np.testing.assert_array_equal(ds[2], [3001, 3002, 3003, 3004, 3005])
    np.testing.assert_array_equal(ds.document_boundaries(2), [0])
    with pytest.raises(IndexError):
        ds.read_sample(3)


def test_document_boundaries_match_tokens():
    docs = random_docs(seed=5)
    ds = GPTDataset(docs, range(len(docs)), 16, 30, seed=2)
    for i in range(len(ds)):
        tokens = ds[i]
        doc_of = tokens // 1000
        expected = np.concatenate([[0], np.flatnonzero(np.diff(doc_of)) + 1])
        np.testing.assert_array_equal(ds.document_boundaries(i), expected)


def test_cache_loads_then_rebuilds_on_change(tmp_path):
    docs = random_docs()
    args = dict(docs=docs, document_range=range(40), seq_len=8, num_samples=20, seed=0,
                cache_dir=str(tmp_path), name="fake")
    first = GPTDataset(**args)
    assert first.built_index
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    mtimes = {f: os.stat(tmp_path / f).st_mtime_ns for f in files}
    second = GPTDataset(**args)
    assert not second.built_index
    assert {f: os.stat(tmp_path / f).st_mtime_ns for f in files} == mtimes
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    for change in (dict(seed=1), dict(seq_len=9), dict(num_samples=21), dict(document_range=range(39)),
                   dict(name="other"), dict(docs=random_docs(seed=1)), dict(order="epochs")):
        ds = GPTDataset(**(args | change))
        assert ds.built_index and ds.key != first.key, change
    assert len(os.listdir(tmp_path)) == 4 * 8


def test_a_cache_of_an_earlier_index_version_is_not_read(tmp_path, monkeypatch):
    """The key holds INDEX_VERSION: indices cached under another rule are rebuilt, not misread."""
    from tessera.data import gpt_dataset

    args = dict(docs=random_docs(), document_range=range(40), seq_len=8, num_samples=20, seed=0,
                cache_dir=str(tmp_path), name="fake")
    monkeypatch.setattr(gpt_dataset, "INDEX_VERSION", 2)
    old = GPTDataset(**args, order="epochs")
    monkeypatch.undo()
    new = GPTDataset(**args, order="epochs")
    assert new.built_index and new.key != old.key and new.description["version"] == 3


def _build_on_ranks(rank, world_size, cache_dir):
    ds = build_on_one_rank(lambda: GPTDataset(random_docs(), range(50), 8, 20, seed=0,
                                              cache_dir=cache_dir, name="fake"))
    return ds.built_index, ds.shuffle_index.tolist()


def test_build_on_one_rank(tmp_path):
    results = run_ranks(_build_on_ranks, 2, str(tmp_path))
    assert [built for built, _ in results] == [True, False]
    assert results[0][1] == results[1][1]
    assert not build_on_one_rank(lambda: False)  # no process group: just calls it


@pytest.mark.parametrize("num_docs", [1, 7, 100, 1001])
@pytest.mark.parametrize("split", ["969,30,1", "8,1,1", "1", "1,0,1", "0,1", "1/1/1"])
def test_splits_disjoint_and_cover(num_docs, split):
    ranges = split_documents(num_docs, split)
    assert len(ranges) == 3
    assert [i for r in ranges for i in r] == list(range(num_docs))


def test_split_megatron_rounding():
    assert split_documents(1000, "969,30,1") == [range(0, 969), range(969, 999), range(999, 1000)]
    # megatron-core rounds the book-ends 3.33 and 6.67 (tessera's earlier rule shifted them: 4, 7)
    assert split_documents(10, "1,1,1") == [range(0, 3), range(3, 7), range(7, 10)]
    assert split_documents(10, "1,0,0") == [range(0, 10), range(10, 10), range(10, 10)]


@pytest.mark.parametrize("bad", ["", "a,b", "1,2,3,4", "0,0,0", "-1,2", "1,,2", "nan"])
def test_bad_split_strings(bad):
    with pytest.raises(ValueError, match=f"split '{bad}'"):
        split_documents(100, bad)


def test_parse_blend():
    assert parse_blend(["prefixA"]) == [(None, "prefixA")]  # (["1", "prefixA"] is a blend of one)
    assert parse_blend(["1", "prefixA"]) == [(1.0, "prefixA")]
    assert parse_blend(["a", "b", "c"]) == [(None, "a"), (None, "b"), (None, "c")]  # by size, as Megatron
    blend = parse_blend(["7", "a", "3", "b"])
    assert [p for _, p in blend] == ["a", "b"]
    assert np.allclose([w for w, _ in blend], [0.7, 0.3])


@pytest.mark.parametrize("bad, named", [
    (["0.7", "a", "0.3"], "'0.3'"),          # odd length
    (["x", "a", "0.3", "b"], "'x'"),         # weight not a number
    (["0.7", "a", "-1", "b"], "'-1'"),       # negative
    (["0", "a"], "'0'"),                     # zero
    (["0.7", "0.3"], "'0.3'"),               # path missing
    (["0.7", ""], "''"),                     # empty path
    (["0.7"], "'0.7'"),                      # lone weight
    ([], "empty"),
])
def test_bad_blends(bad, named):
    with pytest.raises(ValueError, match=named):
        parse_blend(bad)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [3, 1, 1, 5, 0.5], [1.0]])
def test_blend_proportions_exact_in_every_prefix(weights):
    n = 5000
    index, sample_index = blend_indices(weights, n)
    w = np.asarray(weights) / sum(weights)
    onehot = np.eye(len(w), dtype=np.int64)[index]
    counts = np.cumsum(onehot, axis=0)  # counts after t + 1 samples
    targets = np.arange(1, n + 1)[:, None] * w[None, :]
    assert np.abs(counts - targets).max() < 1
    # Each dataset's samples are served in order 0, 1, 2, ...
    for d in range(len(w)):
        assert sample_index[index == d].tolist() == list(range(int(counts[-1, d])))


def test_blended_dataset_reads_its_datasets():
    docs = random_docs()
    a = GPTDataset(docs, range(0, 25), 8, 30, seed=0)
    b = GPTDataset(docs, range(25, 50), 8, 30, seed=0)
    blend = BlendedDataset([a, b], [0.25, 0.75], 40)
    assert len(blend) == 40 and blend.counts.tolist() == [10, 30]
    seen = {0: 0, 1: 0}
    for i in range(40):
        d = int(blend.dataset_index[i])
        np.testing.assert_array_equal(blend[i], [a, b][d][seen[d]])
        np.testing.assert_array_equal(blend.document_boundaries(i), [a, b][d].document_boundaries(seen[d]))
        seen[d] += 1
    with pytest.raises(ValueError, match="has .* samples but the blend draws"):
        BlendedDataset([a, b], [0.25, 0.75], 1000)


def test_cache_key_covers_the_document_lengths(tmp_path):
    """Same name, document count and token count, other lengths: the cache must not be reused."""
    a = GPTDataset(FakeDocs([2, 2, 2, 2, 12]), range(5), 4, 4, seed=0, cache_dir=str(tmp_path), name="p")
    b = GPTDataset(FakeDocs([12, 2, 2, 2, 2]), range(5), 4, 4, seed=0, cache_dir=str(tmp_path), name="p")
    assert a.built_index and b.built_index and a.key != b.key
    b[len(b) - 1]  # readable


@pytest.mark.parametrize("more", [99, 100, 150, 333])
def test_a_longer_run_keeps_the_samples_already_served(more):
    """order="epochs": asking for more samples (past an epoch boundary too) never reorders the
    earlier ones. That is the order's reason to be; megatron's keeps them only while the number
    of epochs stays the same."""
    docs = FakeDocs([100] * 10)  # 1000 tokens per epoch, 99 samples of 10
    short = GPTDataset(docs, range(10), 10, 50, seed=3, order="epochs")
    long = GPTDataset(docs, range(10), 10, more, seed=3, order="epochs")
    for i in range(len(short)):
        assert np.array_equal(short[i], long[i]), i
    short, long = GPTDataset(docs, range(10), 10, 50, seed=3), GPTDataset(docs, range(10), 10, more, seed=3)
    same = all(np.array_equal(short[i], long[i]) for i in range(len(short)))
    assert same == (more <= 99)


def _failing_build(rank, world):
    def build():
        if rank == 0:
            raise ValueError("corrupt index on rank 0")
        return "built"
    try:
        return build_on_one_rank(build)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_a_failure_on_rank_0_reaches_every_rank():
    out = run_ranks(_failing_build, 2, timeout=60)
    assert out[0] == "ValueError: corrupt index on rank 0"
    assert "rank 0 failed" in out[1] and "corrupt index" in out[1]


@pytest.mark.parametrize("damage", ["empty", "half", "missing"])
def test_a_cache_file_cut_short_is_rebuilt_not_trusted(tmp_path, damage):
    """A crash (or a clean-up) can leave the description beside a broken index file: build again."""
    args = dict(docs=random_docs(), document_range=range(50), seq_len=8, num_samples=20, seed=0,
                cache_dir=str(tmp_path), name="fake")
    first = GPTDataset(**args)
    (path,) = tmp_path.glob("*-sample_index.npy")
    if damage == "missing":
        path.unlink()
    else:
        data = path.read_bytes()
        path.write_bytes(b"" if damage == "empty" else data[:len(data) // 2])
    again = GPTDataset(**args)
    assert again.built_index
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not GPTDataset(**args).built_index  # and the repaired cache is used from then on


def test_cache_files_reach_the_disk_before_their_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(os.stat(a).st_ino), real_replace(a, b))[1])
    GPTDataset(random_docs(), range(50), 8, 20, seed=0, cache_dir=str(tmp_path), name="fake")
    assert len(renamed) == 4 and all(inode in synced for inode in renamed)


def test_cache_writers_sharing_a_pid_do_not_collide(tmp_path):
    """Two hosts on one cache folder can run writers with the same pid (containers): each writer
    needs its own temporary file, or one truncates and renames the other's."""
    from tessera.data.gpt_dataset import _save_atomic

    target = str(tmp_path / "x.npy")

    def outer(f):
        f.write(b"outer")
        _save_atomic(target, lambda g: g.write(b"inner"))  # the other writer, meanwhile

    _save_atomic(target, outer)
    assert open(target, "rb").read() == b"outer"
    assert os.listdir(tmp_path) == ["x.npy"]


def _two_corpora(tmp_path, sizes=(300, 900)):
    from tessera.data import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    for name, docs in zip(("a", "b"), sizes):
        with IndexedDatasetWriter(str(tmp_path / name), np.uint16) as writer:
            for n in rng.integers(5, 30, docs):
                writer.add_document(rng.integers(2, 64, int(n)))
    return str(tmp_path / "a"), str(tmp_path / "b")


def _source(tmp_path, paths, num_samples, split="90,10,0"):
    from tessera.config import DataConfig
    from tessera.data.indexed_source import indexed_source

    data = DataConfig(source="indexed", paths=paths, split=split, cache_dir=str(tmp_path / "cache"))
    return indexed_source(data, 16, num_samples, 7)


def test_a_blend_without_weights_draws_one_epoch_of_each_in_proportion_to_its_samples(tmp_path):
    """data.paths=a,b (no weights), as megatron-core: each dataset one epoch of its split, the
    blend weighted by their samples, sample for sample the blend given those weights."""
    a, b = _two_corpora(tmp_path)
    plain = _source(tmp_path, [a, b], 200)
    epochs = [len(ds) for ds in plain.datasets]
    assert [ds.num_epochs for ds in plain.datasets] == [1, 1] and len(plain) == 200 < sum(epochs)
    assert 0.15 < epochs[0] / sum(epochs) < 0.35  # (a holds about a quarter of the samples)
    weighted = _source(tmp_path, [str(epochs[0]), a, str(epochs[1]), b], 200)
    assert all(np.array_equal(plain[i], weighted[i]) for i in range(200))


def test_a_blend_without_weights_goes_on_past_one_epoch_of_each(tmp_path):
    """Where megatron-core's unweighted blend ends (one epoch of each), tessera's goes on: each
    dataset is built for its share, in the same proportion."""
    a, b = _two_corpora(tmp_path)
    epochs = [len(ds) for ds in _source(tmp_path, [a, b], 10).datasets]
    longer = _source(tmp_path, [a, b], 3 * sum(epochs))
    assert len(longer) >= 3 * sum(epochs) and min(ds.num_epochs for ds in longer.datasets) >= 3
    counts = np.bincount(longer.dataset_index[:3 * sum(epochs)])
    assert np.all(np.abs(counts - 3 * np.array(epochs)) <= 1)
    for i in range(0, len(longer), 97):
        longer[i]  # readable throughout


def test_weighted_blend_budgets_as_megatron_core():
    """ceil(n * w) per dataset, the blend that long in all; each dataset built 0.5 % over."""
    from tessera.data.blend import blend_budgets

    assert blend_budgets([0.7, 0.3], 1000) == ([700, 300], [704, 302])
    assert blend_budgets([1 / 3, 2 / 3], 10) == ([4, 7], [5, 8])  # a blend of 11 for 10 asked
    assert blend_budgets([1.0], 256) == ([256], [258])


def test_a_weighted_blend_is_as_long_as_its_shares(tmp_path):
    a, b = _two_corpora(tmp_path)
    blend = _source(tmp_path, ["1", a, "2", b], 10)
    assert len(blend) == 11 and blend.counts.tolist() == [4, 7]
    assert [ds.description["num_samples"] for ds in blend.datasets] == [5, 8]
