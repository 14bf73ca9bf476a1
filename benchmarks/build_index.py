"""Time building GPTDataset's indices for 1e9 tokens (~1e6 documents of ~1000 tokens), seq 2048.

    python benchmarks/build_index.py [--docs 1000000] [--seq-len 2048] [--cache-dir DIR]

Only document lengths exist (no tokens are read), so this measures the index build alone: the
document shuffle, the cumsum/searchsorted sample index and the shuffle index, for one epoch.
With ``--cache-dir`` it also times writing the cache and loading it back. It then times
``blend_indices`` for 1e6 samples over 2 and 3 datasets.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from tessera.data.blend import blend_indices
from tessera.data.gpt_dataset import GPTDataset


class LengthsOnly:
    """A corpus of which only the document lengths are known (enough to build indices)."""

    def __init__(self, lengths: np.ndarray):
        self.sequence_lengths = lengths

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx, offset=0, length=None):
        raise NotImplementedError("lengths only: this corpus has no tokens")


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cache-dir", default=None, help="also time the cache (default: a temp dir)")
    args = parser.parse_args()

    lengths = np.random.default_rng(0).integers(500, 1501, args.docs).astype(np.int32)  # mean 1000
    docs = LengthsOnly(lengths)
    tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (tokens - 1) // args.seq_len  # exactly one epoch
    print(f"{args.docs:,} documents, {tokens:,} tokens, seq_len {args.seq_len}, {num_samples:,} samples")

    ds, build_s = timed(lambda: GPTDataset(docs, range(args.docs), args.seq_len, num_samples, seed=1234))
    assert ds.num_epochs == 1 and len(ds) == num_samples
    print(f"build (no cache): {build_s:.3f} s")

    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or tmp
        ds, save_s = timed(lambda: GPTDataset(docs, range(args.docs), args.seq_len, num_samples, seed=1234,
                                              cache_dir=cache, name="synthetic"))
        assert ds.built_index
        ds, load_s = timed(lambda: GPTDataset(docs, range(args.docs), args.seq_len, num_samples, seed=1234,
                                              cache_dir=cache, name="synthetic"))
        assert not ds.built_index
        print(f"build + write cache: {save_s:.3f} s; load from cache: {load_s:.3f} s")

    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2]):
        _, blend_s = timed(lambda w=weights: blend_indices(w, 1_000_000))
        print(f"blend_indices, 1e6 samples, {len(weights)} datasets: {blend_s:.3f} s")


if __name__ == "__main__":
    main()
