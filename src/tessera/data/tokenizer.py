"""The byte tokenizer: token id = UTF-8 byte (256 ids). Needs no files and no download.

The data-pipeline issue adds Hugging Face ``tokenizers`` BPE; the demo uses bytes so that it runs
anywhere with nothing to fetch.
"""

from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
