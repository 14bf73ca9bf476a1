"""Indexed datasets in an object store: ``data.paths`` as URLs (``s3://bucket/corpus_text_document``,
``gs://...``, any fsspec protocol with its package; the store's standard credentials).

- The ``.idx`` (12 bytes a document beside the tokens) and a ``.tokenizer.json`` are copied whole
  into a local cache, once (a copy whose size differs from the store's is fetched again), and
  read as local files are: memory-mapped, every check of a local dataset made on them.
- The ``.bin`` is never copied whole: a sample is a ranged read, and each block read is kept in
  a sparse local file (fsspec's ``blockcache``), so a sample read again, in a later epoch or a
  restarted run, is read from the local disk. Each rank keeps its own block cache (one writer per
  cache's bookkeeping), under the same folder.

The cache is ``data.cache_dir`` (the sample indices' cache too), or ``~/.cache/tessera``, under
``remote/`` and a digest of the URL.
"""

from __future__ import annotations

import hashlib
import os

BLOCK = 8 * 2**20  # bytes per ranged read (and per cached block)


def is_url(path: str) -> bool:
    return "://" in str(path)


def _filesystem(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def cache_folder(url: str, cache_dir: str) -> str:
    """The local folder kept for a file at ``url``."""
    root = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]
    return os.path.join(root, "remote", f"{os.path.basename(url.rstrip('/'))}-{digest}")


def exists(url: str) -> bool:
    fs, inner = _filesystem(url)
    return fs.isfile(inner)


def size(url: str) -> int:
    fs, inner = _filesystem(url)
    return fs.size(inner)


def local_copy(url: str, cache_dir: str) -> str | None:
    """A local copy of the file at ``url`` (None where there is no such file), fetched once:
    written beside and renamed into place, so a reader never sees a part of one."""
    fs, inner = _filesystem(url)
    if not fs.isfile(inner):
        return None
    folder = cache_folder(url, cache_dir)
    path = os.path.join(folder, os.path.basename(inner))
    if not (os.path.isfile(path) and os.path.getsize(path) == fs.size(inner)):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fs.get_file(inner, tmp)
        os.replace(tmp, path)
    return path


class RangedFile:
    """Bytes of a file in an object store, read by range through a local block cache."""

    def __init__(self, url: str, cache_dir: str):
        import fsspec

        self.url = url
        rank = os.environ.get("RANK", "0")
        storage = os.path.join(cache_folder(url, cache_dir), f"blocks-rank{rank}")
        os.makedirs(storage, exist_ok=True)
        self._file = fsspec.open(f"blockcache::{url}", mode="rb", block_size=BLOCK,
                                 blockcache={"cache_storage": storage}).open()

    def read(self, start: int, count: int) -> bytes:
        self._file.seek(start)
        data = self._file.read(count)
        if len(data) != count:
            raise OSError(f"{self.url}: {count} bytes at {start} asked for, {len(data)} read")
        return data


__all__ = ["is_url", "cache_folder", "exists", "size", "local_copy", "RangedFile"]
