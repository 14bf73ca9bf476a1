"""tessera's sample streams against megatron-core's, as the real client.

On corpora written by tessera's writer, megatron-core's ``BlendedMegatronDatasetBuilder`` builds
its ``GPTDataset`` / ``BlendedDataset`` splits and tessera's ``indexed_source`` its own; the first
256 samples of the train, valid and test splits are equal (megatron-core's tokens and labels),
and so are the indices behind them, value for value and dtype for dtype (document, sample and
shuffle indices, blend indices, lengths and budgets).

megatron-core is a test dependency (the ``test`` extra); where it does not import, these tests
skip. It is imported inside a fixture, so collecting the fast subset does not pay for it.
"""

import types

import numpy as np
import pytest

from tessera.config import DataConfig
from tessera.data import IndexedDatasetWriter
from tessera.data.indexed_source import indexed_source

pytestmark = pytest.mark.slow  # (importing megatron-core takes seconds)

EOD = 1
CORPORA = {"a": 517, "b": 700, "ten": 10}  # 517: "969,30,1" splits it [0, 501) where the old rule gave [0, 500)


@pytest.fixture(scope="module")
def mcore():
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder",
                                  reason="megatron-core is not installed here (pip install -e '.[test]')")
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    blended = pytest.importorskip("megatron.core.datasets.blended_dataset")
    return types.SimpleNamespace(Builder=builder.BlendedMegatronDatasetBuilder, GPTDataset=gpt.GPTDataset,
                                 Config=gpt.GPTDatasetConfig, BlendedDataset=blended.BlendedDataset)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    for seed, (name, docs) in enumerate(CORPORA.items()):
        rng = np.random.default_rng(seed)
        with IndexedDatasetWriter(str(root / name), np.uint16) as writer:
            for _ in range(docs):
                writer.add_document(np.append(rng.integers(2, 500, int(rng.integers(1, 60))), EOD))
    return root


def megatron_splits(mcore, blend, split, seq_len, seed, sizes):
    """megatron-core's three splits, as Megatron-LM's pretrain_gpt builds them."""
    tokenizer = types.SimpleNamespace(vocab_size=512, eod=EOD, unique_identifiers={"class": "test"})
    config = mcore.Config(random_seed=seed, sequence_length=seq_len, blend=blend, split=split, tokenizer=tokenizer,
                          reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                          create_attention_mask=False)
    return mcore.Builder(mcore.GPTDataset, sizes, lambda: True, config).build()


def assert_same_stream(mcore, ours, theirs, n=256):
    assert len(ours) == len(theirs)
    if isinstance(theirs, mcore.BlendedDataset):
        for name in ("dataset_index", "dataset_sample_index"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        pairs = list(zip(ours.datasets, theirs.datasets))
    else:
        pairs = [(ours, theirs)]
    for mine, other in pairs:
        assert mine.num_epochs == len(other.document_index) // len(other.indices)
        for name in ("document_index", "sample_index", "shuffle_index"):
            a, b = getattr(mine, name), getattr(other, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    for i in range(min(n, len(theirs))):
        sample, served = ours[i], theirs[i]
        np.testing.assert_array_equal(sample[:-1], served["tokens"].numpy(), err_msg=f"sample {i}")
        np.testing.assert_array_equal(sample[1:], served["labels"].numpy(), err_msg=f"sample {i}")


def check_splits(mcore, tmp_path, paths, blend, split, seq_len, seed, sizes, order="megatron"):
    theirs = megatron_splits(mcore, blend, split, seq_len, seed, sizes)
    data = DataConfig(source="indexed", paths=paths, split=split, cache_dir=str(tmp_path / "cache"), sample_order=order)
    for k in range(3):
        ours = indexed_source(data, seq_len, sizes[k], seed, split=k)
        assert_same_stream(mcore, ours, theirs[k])
    return theirs


@pytest.mark.parametrize("seq_len, seed", [(16, 1234), (7, 3), (64, 2**31 + 11)])
@pytest.mark.parametrize("split", ["969,30,1", "8,1,1", "98,2,0"])
@pytest.mark.parametrize("train", [700, 1500])
def test_one_dataset(mcore, corpora, tmp_path, split, seq_len, seed, train):
    """A few thousand train samples (one epoch or two, the second apart or not), 256 of the
    valid and test splits (tens of epochs of a few documents); a zero weight gives no split."""
    a = str(corpora / "a")
    theirs = megatron_splits(mcore, ([a], None), split, seq_len, seed, [train, 256, 256])
    data = DataConfig(source="indexed", paths=[a], split=split, cache_dir=str(tmp_path / "cache"))
    for k, size in enumerate([train, 256, 256]):
        if theirs[k] is None:  # megatron-core builds no dataset for a zero weight; tessera's part is empty
            assert split.endswith(",0") and k == 2
            continue
        assert_same_stream(mcore, indexed_source(data, seq_len, size, seed, split=k), theirs[k])


@pytest.mark.parametrize("seed", [0, 77])
def test_1_1_1_on_ten_documents(mcore, corpora, tmp_path, seed):
    """[0, 3), [3, 7), [7, 10), as megatron-core (the old rule gave [0, 4), [4, 7))."""
    ten = str(corpora / "ten")
    theirs = check_splits(mcore, tmp_path, [ten], ([ten], None), "1,1,1", 8, seed, [256, 256, 256])
    assert [len(ds.indices) for ds in theirs] == [3, 4, 3]


@pytest.mark.parametrize("seq_len, seed", [(16, 1234), (33, 5)])
@pytest.mark.parametrize("split", ["969,30,1", "1,1,1", "8,1,1"])
def test_a_weighted_blend_of_two(mcore, corpora, tmp_path, split, seq_len, seed):
    a, b = str(corpora / "a"), str(corpora / "b")
    check_splits(mcore, tmp_path, ["0.7", a, "0.3", b], ([a, b], [0.7, 0.3]), split, seq_len, seed, [1000, 256, 256])


def test_a_blend_of_one_weighted_path(mcore, corpora, tmp_path):
    """["1", a] is a blend (each dataset built 0.5 % over), unlike [a]."""
    a = str(corpora / "a")
    check_splits(mcore, tmp_path, ["1", a], ([a], [1.0]), "969,30,1", 16, 9, [1500, 256, 256])


def test_a_blend_without_weights(mcore, corpora, tmp_path):
    """One epoch of each dataset, in proportion to its samples (within those epochs: past them
    megatron-core's blend ends, see test_gpt_dataset.py)."""
    a, b = str(corpora / "a"), str(corpora / "b")
    theirs = check_splits(mcore, tmp_path, [a, b], ([a, b], None), "8,1,1", 16, 1234, [1000, 100, 100])
    assert [len(ds) for ds in theirs] == [1000, 100, 100]


def test_the_training_and_validation_streams_of_a_config(mcore, corpora, tmp_path):
    """Through tessera's config: a run of train.steps global batches, validation every
    train.eval_every steps, reads megatron-core's splits built for Megatron-LM's sample counts
    (train_iters * global_batch; (train_iters // eval_interval + 1) * eval_iters * global_batch)."""
    from tessera.config import load_config
    from tessera.training.data_feed import build_source

    a, b = str(corpora / "a"), str(corpora / "b")
    cfg = load_config(None, ["data.source=indexed", f"data.paths=0.6,{a},0.4,{b}", "data.split=90,8,2",
                             f"data.cache_dir={tmp_path / 'cache'}", "model.seq_len=32", "train.seed=42",
                             "train.steps=50", "train.global_batch=16", "train.micro_batch=4",
                             "train.eval_every=20", "train.eval_batches=4", "parallel.dp=1"])
    sizes = [50 * 16, (50 // 20 + 1) * 4 * 16, 4 * 16]
    theirs = megatron_splits(mcore, ([a, b], [0.6, 0.4]), "90,8,2", 32, 42, sizes)
    for k in (0, 1):
        assert_same_stream(mcore, build_source(cfg, split=k), theirs[k])


def test_the_per_epoch_order_is_not_megatron_cores(mcore, corpora, tmp_path):
    """data.sample_order=epochs: the same documents in the same split, in another order."""
    a = str(corpora / "a")
    theirs = megatron_splits(mcore, ([a], None), "969,30,1", 16, 1234, [1500, 256, 256])
    data = DataConfig(source="indexed", paths=[a], split="969,30,1", cache_dir=str(tmp_path / "cache"),
                      sample_order="epochs")
    ours = indexed_source(data, 16, 1500, 1234)
    assert ours.range.start == theirs[0].indices[0] and ours.range.stop == theirs[0].indices[-1] + 1
    assert not np.array_equal(ours.document_index, theirs[0].document_index)
