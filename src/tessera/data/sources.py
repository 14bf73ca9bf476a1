"""Where samples come from. A source maps a global sample index to ``seq_len + 1`` token ids,
deterministically from the seed, so every layout sees the same data in the same order.

- :class:`BuiltinCorpus`: the text of Python's own documentation topics (``pydoc_data``, part of
  the standard library), byte-tokenized, cut into windows, shuffled per epoch.
- :class:`SyntheticTokens`: seeded random tokens (for benchmarks and tests).
"""

from __future__ import annotations

import numpy as np

from tessera.data.tokenizer import ByteTokenizer


def builtin_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


class BuiltinCorpus:
    """Non-overlapping windows of ``seq_len + 1`` bytes of the corpus, reshuffled every epoch."""

    def __init__(self, seq_len: int, seed: int):
        self.tokenizer = ByteTokenizer()
        self.tokens = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8).astype(np.int64)
        self.seq_len, self.seed = seq_len, seed
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"the builtin corpus is shorter than model.seq_len={seq_len}")
        self._order: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return self._order[1]

    def __getitem__(self, index: int) -> np.ndarray:
        epoch, i = divmod(index, self.windows)
        start = int(self._permutation(epoch)[i]) * self.seq_len
        return self.tokens[start: start + self.seq_len + 1]


class SyntheticTokens:
    """Sample ``i`` is uniform random ids drawn from a generator seeded by (seed, i)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def __getitem__(self, index: int) -> np.ndarray:
        return np.random.default_rng([self.seed, index]).integers(0, self.vocab_size, self.seq_len + 1)
