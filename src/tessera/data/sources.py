"""Where samples come from. A source maps a global sample index to ``seq_len + 1`` token ids,
deterministically from the seed, so every layout sees the same data in the same order.

- :class:`SyntheticTokens`: seeded random tokens (for benchmarks and tests).
- indexed datasets, and the built-in demo corpus written as one: ``indexed_source.py``.
"""

from __future__ import annotations

import numpy as np


class SyntheticTokens:
    """Sample ``i`` is uniform random ids drawn from a generator seeded by (seed, i)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def __getitem__(self, index: int) -> np.ndarray:
        return np.random.default_rng([self.seed, index]).integers(0, self.vocab_size, self.seq_len + 1)
