"""Tokenizers for generation (the sample printed after training, ``tessera generate`` and
``eval``): bytes (the built-in corpus's, 256 ids; no files, no download; exported as an equivalent
``tokenizer.json``), or a Hugging Face ``tokenizers`` file, the one an indexed dataset was made
with (``tessera preprocess`` saves a trained one as ``PREFIX.tokenizer.json``).
"""

from __future__ import annotations

import os

from tessera.data import remote
from tessera.config import ConfigError, DataConfig


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @staticmethod
    def hf_json() -> str:
        """The same mapping as a Hugging Face ``tokenizer.json`` (what an export of a model trained
        on bytes carries): a byte-level BPE without merges, id i being byte i (GPT-2's printable
        stand-in characters for the bytes), no added tokens, so that `tokenizers` and transformers'
        AutoTokenizer encode any text to its UTF-8 bytes and decode ids back as ``decode`` does."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        stand_in = _byte_characters()
        tokenizer = Tokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer.to_str()


def _byte_characters() -> dict[int, str]:
    """GPT-2's byte -> character map (printable bytes as themselves, the others shifted past 255),
    which byte-level pre-tokenization and decoding use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


class FileTokenizer:
    """A ``tokenizer.json``: ids of the text alone (no special tokens), as preprocessing wrote."""

    def __init__(self, path: str):
        from tessera.data.preprocess import load_tokenizer  # (tokenizers: imported only here)

        self.path, self._tok = path, load_tokenizer(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def vocabulary(self) -> dict[str, int]:
        """Every token and its id, added ones too (two tokenizers agree on ids where these agree)."""
        return self._tok.get_vocab(with_added_tokens=True)


def file_tokenizer(path: str, key: str, fix: str) -> FileTokenizer:
    from tessera.data.preprocess import PreprocessError

    target = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(target):
        raise ConfigError(key, f"{target}: no such file (a tokenizer.json or a folder holding one)", fix)
    try:
        return FileTokenizer(path)
    except PreprocessError as e:
        raise ConfigError(key, str(e), fix) from None


def data_tokenizer(spec: str, data: DataConfig, key: str, fix: str):
    """The tokenizer of ``spec`` (a tokenizer.json or a folder holding one), or where empty the
    data's own: bytes for the built-in corpus, ``PREFIX.tokenizer.json`` beside the first indexed
    dataset. Refused under ``key`` with ``fix`` where there is none (synthetic tokens have no text)."""
    if spec:
        tokenizer = file_tokenizer(spec, key, fix)
    elif data.source == "builtin":
        tokenizer = ByteTokenizer()
    elif data.source == "indexed":
        from tessera.data.blend import parse_blend

        beside = parse_blend(data.paths)[0][1] + ".tokenizer.json"
        if remote.is_url(beside):  # (a dataset in an object store: its tokenizer copied into the cache)
            beside = remote.local_copy(beside, data.cache_dir) or beside
        if not os.path.isfile(beside):
            raise ConfigError(key, f"the data's tokenizer is missing: no {beside} (`tessera preprocess` "
                                   "writes it beside the pair)", fix)
        tokenizer = file_tokenizer(beside, key, fix)
    else:
        raise ConfigError(key, f"data.source={data.source} has no text (random token ids, no tokenizer)", fix)
    return tokenizer


def sample_tokenizer(spec: str, data: DataConfig, vocab_size: int, prompt: str):
    """The closing sample's tokenizer: ``train.sample_tokenizer``, else the data's own
    (:func:`data_tokenizer`); refused where it has more ids than the model, or where the prompt
    encodes to nothing."""
    tokenizer = data_tokenizer(spec, data, "train.sample_tokenizer",
                               "give the tokenizer.json the data was made with, or set train.sample_tokens=0")
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("model.vocab_size", f"{vocab_size} is smaller than the sample tokenizer's "
                          f"{tokenizer.vocab_size} ids", "set model.vocab_size to the tokenizer's size or more")
    if not tokenizer.encode(prompt):
        raise ConfigError("train.sample_prompt", f"{prompt!r} encodes to no tokens", "give some text to continue")
    return tokenizer
