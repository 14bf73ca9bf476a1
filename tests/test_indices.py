"""indices.py without megatron-core: the split rule by hand, and the three indices against
megatron-core's rules restated here as plain loops (helpers.cpp's sample loop, its generator's
draws in its order). test_megatron_data.py compares with megatron-core itself where installed."""

import numpy as np
import pytest

from tessera.data.indices import (build_sample_index, epoch_indices, megatron_indices, normalize, num_epochs_needed,
                                  parse_split, separate_final_epoch, split_documents)


@pytest.mark.parametrize("num_docs, split, expected", [
    (10, "1,1,1", [(0, 3), (3, 7), (7, 10)]),             # book-ends 3.33, 6.67 rounded, not shifted
    (1000, "969,30,1", [(0, 969), (969, 999), (999, 1000)]),
    (517, "969,30,1", [(0, 501), (501, 516), (516, 517)]),   # the shifted rule gave [0, 500), [500, 516)
    (113, "969,30,1", [(0, 109), (109, 113), (113, 113)]),
    (5, "1,1", [(0, 2), (2, 5), (5, 5)]),                  # round(2.5) = 2: halves to even
    (7, "1,1", [(0, 4), (4, 7), (7, 7)]),                  # round(3.5) = 4
    (10, "1,0,1", [(0, 5), (5, 5), (5, 10)]),              # a zero weight: empty
    (10, "1,0,0", [(0, 10), (10, 10), (10, 10)]),
    (10, "0,1", [(0, 0), (0, 10), (10, 10)]),
])
def test_the_split_rule_by_hand(num_docs, split, expected):
    assert [(r.start, r.stop) for r in split_documents(num_docs, split)] == expected


def test_weights_are_normalised_over_numpys_sum():
    """Split and blend weights: megatron-core divides by numpy's sum, which adds more than 8
    numbers in another order than Python's sum (and rounds otherwise)."""
    from tessera.data.blend import parse_blend

    ws = [0.6, 0.4, 0.6, 0.4, 0.5, 0.9, 0.3, 0.7, 0.2, 0.8]  # numpy: 5.4, Python: 5.3999999999999995
    assert normalize(ws) == (np.array(ws) / 5.4).tolist() != [w / sum(ws) for w in ws]
    assert [w for w, _ in parse_blend([x for w in ws for x in (str(w), "p")])] == normalize(ws)
    assert parse_split("969,30,1") == normalize([969, 30, 1])


def test_the_split_rule_covers_every_document_once_on_many_sizes():
    for num_docs in range(0, 3000, 7):
        for split in ("969,30,1", "1,1,1", "98,2,0", "0.1,0.2,0.3"):
            assert [i for r in split_documents(num_docs, split) for i in r] == list(range(num_docs))


# --- megatron-core's rules, restated -------------------------------------------------------------

def loop_sample_index(sizes, document_index, seq_len):
    """helpers.cpp's build_sample_idx, its loop as written (an extra token, the last partial
    sample dropped)."""
    tokens = int(sum(int(sizes[d]) for d in document_index))
    num_samples = (tokens - 1) // seq_len
    rows, d, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_len + 1
        while remaining:
            length = int(sizes[document_index[d]]) - offset
            remaining -= length
            if remaining <= 0:  # the sample ends in this document; the next starts on its last token
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
        rows.append((d, offset))
    return np.array(rows)


def drawn_indices(lengths, documents, seq_len, num_samples, seed):
    """megatron-core's GPTDataset indices, its draws spelt out: shuffle the epochs' document ids
    (a last epoch under 80 % used apart, after the rest), then the samples (likewise)."""
    T = int(lengths[documents].sum())
    epochs = 1
    while epochs * T < num_samples * seq_len + 1:
        epochs += 1
    rng = np.random.RandomState(seed)
    separate = False
    if epochs > 1:
        before = ((epochs - 1) * T - 1) // seq_len
        separate = num_samples - before < int(0.8 * ((T - 1) // seq_len))
    if separate:
        head, last = np.tile(documents, epochs - 1).astype(np.int32), documents.astype(np.int32)
        rng.shuffle(head)
        rng.shuffle(last)
        document_index = np.concatenate([head, last])
    else:
        document_index = np.tile(documents, epochs).astype(np.int32)
        rng.shuffle(document_index)
    sample_index = loop_sample_index(lengths, document_index, seq_len)
    total = len(sample_index) - 1
    first = before if separate else total
    head = np.arange(first, dtype=np.uint32)
    rng.shuffle(head)
    tail = np.arange(first, total, dtype=np.uint32)
    if len(tail):
        rng.shuffle(tail)
    return document_index, sample_index, np.concatenate([head, tail])


@pytest.mark.parametrize("seed", [0, 1234, 2**32 - 1])
@pytest.mark.parametrize("seq_len", [1, 5, 16, 64])
@pytest.mark.parametrize("num_samples", [1, 40, 150, 700])
def test_megatron_indices_equal_the_rules_restated(seed, seq_len, num_samples):
    lengths = np.random.default_rng(seq_len).integers(1, 50, 60).astype(np.int32)
    lengths[[0, 9, 10, 31]] = 0  # empty documents (megatron's own writer refuses them; others may not)
    documents = np.arange(5, 45)
    got = megatron_indices(lengths, range(5, 45), seq_len, num_samples, seed)
    want = drawn_indices(lengths, documents, seq_len, num_samples, seed)
    for name, g, w in zip(("document", "sample", "shuffle"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert [a.dtype for a in got] == [np.int32, np.int32, np.uint32]


def test_the_final_epoch_is_shuffled_apart_under_80_percent():
    # 10 documents of 100 tokens, seq_len 10: 99 samples in one epoch, 199 in two. Two epochs are
    # needed from 100 samples on; the second is shuffled apart while it serves fewer than
    # int(0.8 * 99) = 79 of them, that is up to 99 + 78 = 177 samples.
    lengths = np.full(10, 100, dtype=np.int32)
    assert separate_final_epoch(99, 1000, 10) is None and num_epochs_needed(1000, 10, 99) == 1
    assert separate_final_epoch(177, 1000, 10) == 99
    assert separate_final_epoch(178, 1000, 10) is None
    document_index, _, shuffle_index = megatron_indices(lengths, range(10), 10, 177, seed=0)
    assert sorted(document_index[10:]) == list(range(10))  # the last epoch's documents, on their own
    assert sorted(shuffle_index[:99]) == list(range(99)) and sorted(shuffle_index[99:]) == list(range(99, 199))
    document_index, _, shuffle_index = megatron_indices(lengths, range(10), 10, 178, seed=0)
    assert sorted(document_index[10:]) != list(range(10))  # two epochs shuffled together
    assert sorted(shuffle_index[:99]) != list(range(99))


def test_one_epoch_when_no_number_of_samples_is_asked():
    lengths = np.full(10, 100, dtype=np.int32)
    document_index, sample_index, shuffle_index = megatron_indices(lengths, range(10), 10, None, seed=3)
    assert len(document_index) == 10 and len(sample_index) == 100 and len(shuffle_index) == 99


def test_seeds_past_32_bits_seed_with_their_two_words():
    lengths = np.full(10, 100, dtype=np.int32)
    a = megatron_indices(lengths, range(10), 10, 50, seed=2**40 + 5)
    b = megatron_indices(lengths, range(10), 10, 50, seed=2**41 + 5)
    assert not np.array_equal(a[0], b[0])
    rng = np.random.RandomState([5, 2**8])
    np.testing.assert_array_equal(a[0], rng.permutation(10))


def test_the_sample_index_starts_at_0_0_even_on_an_empty_document():
    rows = build_sample_index(np.array([0, 0, 5, 7]), 4)
    np.testing.assert_array_equal(rows, [[0, 0], [2, 4], [3, 3]])
    np.testing.assert_array_equal(rows, loop_sample_index(np.array([0, 0, 5, 7]), [0, 1, 2, 3], 4))


def test_the_per_epoch_order_keeps_each_epoch_apart():
    lengths = np.full(10, 100, dtype=np.int32)
    document_index, sample_index, shuffle_index = epoch_indices(lengths, range(10), 10, 250, seed=0)
    assert len(document_index) == 30
    for e in range(3):
        assert sorted(document_index[10 * e:10 * (e + 1)]) == list(range(10))
    epoch_of_last_token = (shuffle_index + 1) * 10 // 1000
    assert np.all(np.diff(epoch_of_last_token) >= 0)
