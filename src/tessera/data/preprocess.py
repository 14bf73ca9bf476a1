"""Tokenize JSON-lines text into a Megatron ``.bin``/``.idx`` pair (Megatron's ``preprocess_data.py``).

One input line = one JSON object = one document; the text under ``key`` is encoded with a Hugging
Face ``tokenizers`` tokenizer and an end-of-document (EOD) token is appended (Megatron's
``--append-eod``), so documents packed back to back in a training sample stay separable.

The tokenizer is a ``tokenizer.json`` (or a folder holding one), or ``bpe:V``: a byte-level BPE of
V ids trained on the input itself. Either way it is saved beside the pair as
``PREFIX.tokenizer.json``, the data's own tokenizer (the trainer's sample decodes with it).
Byte-level means every string encodes, nothing maps to "unknown", and decoding gives the text
back exactly.

Parallelism. With ``workers=1`` (the default) everything runs in this process and the tokenizers
library's ``encode_batch`` spreads each chunk over all cores with its own threads: the simplest
path, and already parallel where nearly all the time goes (encoding). ``workers=N`` starts N
processes that each parse JSON *and* encode a chunk of lines (library threads off, so N is the
core count used), which also parallelises the JSON parsing and Python glue that stay serial on
the first path; use it on many-core machines. Each worker is a fresh ``spawn``ed interpreter
(numpy and tokenizers, not torch), so it does not pay off for small inputs. Chunks are submitted
a bounded number ahead and written in input order, so memory stays flat and the output is
identical for any N.

Megatron names its outputs ``{prefix}_{key}_document.bin``; here the prefix is the name itself:
``PREFIX.bin`` and ``PREFIX.idx``. Existing outputs are never replaced unless asked
(``overwrite``), and nothing is written until the whole input has encoded: the pair and its
tokenizer appear together at the end, or not at all.
"""

from __future__ import annotations

import gzip
import json
import os
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from tessera.config import a_or_an
from tessera.data.indexed import IndexedDatasetWriter, best_dtype, bin_path, idx_path

EOD_TOKEN = "<|endoftext|>"
# Looked up in order in a given tokenizer: GPT-2/NeoX, Llama 3, SentencePiece-style, others.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# A chunk is sent to a worker when it reaches either bound: large enough that process hand-off
# costs little, small enough that the progress bar moves.
CHUNK_LINES = 1024
CHUNK_BYTES = 1 << 20


class PreprocessError(ValueError):
    """Bad input or tokenizer; the message names the file (and line) at fault."""


@dataclass(frozen=True, slots=True)
class PreprocessResult:
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    dtype: np.dtype
    vocab_size: int
    eod_id: int
    bin_path: str
    idx_path: str
    tokenizer_path: str


def input_files(path: str | os.PathLike) -> list[Path]:
    """The file itself, or every ``*.jsonl`` / ``*.jsonl.gz`` of a directory, sorted by name."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.is_file() and (p.name.endswith(".jsonl") or p.name.endswith(".jsonl.gz")))
        if not files:
            raise PreprocessError(f"{path}: no *.jsonl or *.jsonl.gz files in this directory")
        return files
    if not path.is_file():
        raise PreprocessError(f"{path}: no such file or directory")
    return [path]


def _lines(path: Path) -> Iterator[tuple[bytes, int]]:
    """``(line, bytes read from disk so far)`` for a .jsonl or .jsonl.gz file.

    Progress counts bytes as stored (compressed for .gz), the only measure known before reading.
    """
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        try:
            for line in stream:
                yield line, raw.tell()
        except (OSError, EOFError) as e:  # gzip: bad or truncated archive
            raise PreprocessError(f"{path}: cannot read: {e}") from e


def parse_text(line: bytes, key: str, path: str, lineno: int) -> str | None:
    """The text of one JSONL line, or None for a blank line. Errors name ``file:line``."""
    if not line.strip():
        return None
    try:  # decoded strictly: json.loads(bytes) would let surrogate bytes (CESU-8) through
        record = json.loads(line.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreprocessError(f"{path}:{lineno}: not valid JSON ({e}); the input is JSON Lines, "
                              "one object per line such as {\"text\": \"...\"}") from None
    if not isinstance(record, dict):
        kind = {list: "an array", str: "a string"}.get(type(record), f"a {type(record).__name__}")
        raise PreprocessError(f"{path}:{lineno}: {kind}, not an object; the input is JSON Lines, one object per "
                              "line such as {\"text\": \"...\"} (a whole JSON array is not read)")
    if key not in record:
        raise PreprocessError(f"{path}:{lineno}: no key {key!r} (found keys {sorted(record)[:10]}); "
                              "choose one with --key")
    text = record[key]
    if not isinstance(text, str):
        raise PreprocessError(f"{path}:{lineno}: {key!r} is {a_or_an(type(text).__name__)}, expected a string")
    if b"\\u" in line:  # only an escape can make a lone surrogate, which no tokenizer encodes
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PreprocessError(f"{path}:{lineno}: {key!r} holds an unpaired surrogate escape "
                                  f"({text[e.start]!r} at character {e.start}): not text in any encoding") from None
    return text


def iter_texts(files: list[Path], key: str) -> Iterator[str]:
    for path in files:
        for lineno, (line, _) in enumerate(_lines(path), 1):
            text = parse_text(line, key, str(path), lineno)
            if text is not None:
                yield text


# --- tokenizer -----------------------------------------------------------------------------------

def train_bpe(files: list[Path], key: str, vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids (256 bytes + ``<|endoftext|>`` + merges) on the input.

    Reads the input once more than encoding does; meant for small corpora and tests (it needs
    no download), not as a substitute for a tokenizer trained on a representative sample.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < minimum:
        raise PreprocessError(f"bpe:{vocab_size}: a byte-level BPE needs at least {minimum} ids "
                              "(256 bytes and the end-of-document token)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(iter_texts(files, key), trainer=trainer)
    return tokenizer


def load_tokenizer(spec: str):
    """A ``tokenizer.json`` path or a folder holding one (never a download)."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise PreprocessError(f"{path}: no such tokenizer file (--tokenizer takes a tokenizer.json, "
                              "a folder containing one, or bpe:V to train one)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for malformed files
        raise PreprocessError(f"{path}: not a Hugging Face tokenizers file ({e})") from None


def find_eod(tokenizer, name: str | None = None) -> int:
    """The id of the end-of-document token: ``name`` if given, else the first known EOD name."""
    for candidate in (name,) if name else EOD_CANDIDATES:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return token_id
    looked = repr(name) if name else ", ".join(EOD_CANDIDATES)
    raise PreprocessError(f"the tokenizer has no end-of-document token (looked for {looked}); "
                          "name one with --eod-token")


# --- encoding ------------------------------------------------------------------------------------

_worker_state: dict = {}


def _init_worker(tokenizer_json: str, key: str, eod_id: int) -> None:
    # N workers each running the library's thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True  # not serialised: see encode_chunk
    _worker_state.update(tokenizer=tokenizer, key=key, eod_id=eod_id)


def encode_chunk(tokenizer, key: str, eod_id: int, path: str, first_lineno: int,
                 lines: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Parse and encode consecutive lines: ``(tokens, lengths)``, EOD after each document.

    ``add_special_tokens=False``: the ids are the text's and the EOD's only, like Megatron's GPT
    preprocessing; a tokenizer's post-processor (BOS, [CLS] ...) is not applied. The caller sets
    ``tokenizer.encode_special_tokens``: a special token's name written in the text (a page about
    GPT-2 quoting ``<|endoftext|>``) is encoded as text, as Megatron's GPT-2 BPE does, not as the
    special id, which would put an EOD inside the document.
    """
    texts = [t for i, line in enumerate(lines)
             if (t := parse_text(line, key, path, first_lineno + i)) is not None]
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encodings], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=np.int64)
    at = 0
    for encoding in encodings:
        tokens[at:at + len(encoding.ids)] = encoding.ids
        at += len(encoding.ids)
        tokens[at] = eod_id
        at += 1
    return tokens, lengths


def _encode_in_worker(path: str, first_lineno: int, lines: list[bytes]):
    s = _worker_state
    return encode_chunk(s["tokenizer"], s["key"], s["eod_id"], path, first_lineno, lines)


def _chunks(files: list[Path]) -> Iterator[tuple[str, int, list[bytes], int]]:
    """``(file, first line number, lines, disk bytes consumed since the previous chunk)``."""
    for path in files:
        lines: list[bytes] = []
        size = first = done = 0
        position = 0
        for lineno, (line, position) in enumerate(_lines(path), 1):
            if not lines:
                first = lineno
            lines.append(line)
            size += len(line)
            if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                yield str(path), first, lines, position - done
                done, lines, size = position, [], 0
        if lines or position > done:
            yield str(path), first, lines, position - done


def preprocess(input: str | os.PathLike, output_prefix: str | os.PathLike, tokenizer: str, key: str = "text",
               workers: int = 1, vocab_size: int | None = None, eod_token: str | None = None,
               progress: bool = True, overwrite: bool = False) -> PreprocessResult:
    """Tokenize ``input`` into ``output_prefix.bin/.idx``; see the module docstring.

    ``vocab_size`` picks the token dtype (default: the tokenizer's size); give the model's padded
    vocabulary to match a Megatron run that used one. For ``tokenizer="bpe"`` it is also the size
    to train. The output pair appears only once complete (:class:`IndexedDatasetWriter`), and the
    tokenizer (``PREFIX.tokenizer.json``) with it; existing outputs are an error unless ``overwrite``.
    """
    from tqdm import tqdm

    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if vocab_size is not None and vocab_size < 1:  # else 0 would silently mean "the tokenizer's"
        raise PreprocessError(f"--vocab-size must be >= 1, got {vocab_size}")
    files = input_files(input)
    output_prefix = os.fspath(output_prefix)
    train = tokenizer == "bpe" or tokenizer.startswith("bpe:")
    tokenizer_path = output_prefix + ".tokenizer.json"
    outputs = [bin_path(output_prefix), idx_path(output_prefix), tokenizer_path]
    existing = [p for p in outputs if os.path.exists(p)]
    if existing and not overwrite:
        raise PreprocessError(f"{', '.join(existing)} already exist{'s' * (len(existing) == 1)}; "
                              "choose another --output-prefix, or pass --overwrite to replace")
    if train:
        size_text = tokenizer[4:] or (str(vocab_size) if vocab_size else "")
        if not size_text.isdigit():
            raise PreprocessError(f"--tokenizer {tokenizer}: expected bpe:V with V the vocabulary size, e.g. bpe:32000")
        tok = train_bpe(files, key, int(size_text))
    else:
        tok = load_tokenizer(tokenizer)
    eod_id = find_eod(tok, eod_token)
    tokenizer_size = tok.get_vocab_size(with_added_tokens=True)
    vocab = vocab_size or tokenizer_size
    if vocab < tokenizer_size:
        raise PreprocessError(f"--vocab-size {vocab} is smaller than the tokenizer's {tokenizer_size} ids")
    dtype = np.dtype(best_dtype(vocab))
    # Special tokens' names in the text are text (see encode_chunk). Not saved with the tokenizer,
    # so set here and in each worker; the copy saved beside the data keeps the library's default.
    tok.encode_special_tokens = True

    disk_bytes = sum(p.stat().st_size for p in files)
    bar = tqdm(total=disk_bytes, unit="B", unit_scale=True, disable=not progress,
               desc=f"tokenizing {len(files)} file{'s' * (len(files) != 1)}", dynamic_ncols=True)
    documents = tokens = 0
    start = time.perf_counter()

    def consume(result, consumed: int) -> None:
        nonlocal documents, tokens
        chunk_tokens, lengths = result
        writer.add_documents(chunk_tokens, lengths)
        documents += len(lengths)
        tokens += len(chunk_tokens)
        bar.update(consumed)
        bar.set_postfix_str(f"{documents / max(time.perf_counter() - start, 1e-9):,.0f} docs/s, {documents:,} docs",
                            refresh=False)

    scratch = f"{tokenizer_path}.tmp-{uuid.uuid4().hex}"
    try:
        with IndexedDatasetWriter(output_prefix, dtype) as writer:
            if workers == 1:
                for path, first, lines, consumed in _chunks(files):
                    consume(encode_chunk(tok, key, eod_id, path, first, lines), consumed)
            else:
                # spawn, not fork: the parent may already run the tokenizers thread pool (training),
                # and forking a threaded process can deadlock.
                with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                         initargs=(tok.to_str(), key, eod_id)) as pool:
                    pending: deque = deque()
                    for path, first, lines, consumed in _chunks(files):
                        pending.append((pool.submit(_encode_in_worker, path, first, lines), consumed))
                        if len(pending) >= 4 * workers:  # bounded look-ahead: memory stays flat
                            future, n = pending.popleft()
                            consume(future.result(), n)
                    while pending:
                        future, n = pending.popleft()
                        consume(future.result(), n)
            bar.update(disk_bytes - bar.n)  # gzip may stop short of the file's last bytes
            if not documents:  # an empty dataset fails only later, in training, far from the cause
                raise PreprocessError(f"{os.fspath(input)}: no documents (empty, or only blank lines)")
            # The data's tokenizer, written before the pair is published (a full disk fails here,
            # and an old pair keeps its own tokenizer) and moved beside it right after.
            tok.save(scratch)
        os.replace(scratch, tokenizer_path)
    finally:
        bar.close()
        if os.path.exists(scratch):
            os.remove(scratch)
    return PreprocessResult(documents=documents, tokens=tokens, input_bytes=disk_bytes,
                            seconds=time.perf_counter() - start, dtype=dtype, vocab_size=vocab, eod_id=eod_id,
                            bin_path=bin_path(output_prefix), idx_path=idx_path(output_prefix),
                            tokenizer_path=tokenizer_path)
