"""Where checkpoints live: a local (or mounted) folder, or an object store's URL through fsspec
(``s3://bucket/run``, ``gs://...``, ``file://...``, ``memory://...``: any protocol fsspec has,
with its package installed: ``pip install s3fs`` for s3, ``gcsfs`` for gs).

Local folders keep POSIX's atomic rename: a save writes ``step_N.partial`` and renames it. An
object store has no rename (a "rename" copies every object), so there a save writes ``step_N``
directly and ``tessera.json``, one object written last, is its commit marker: a checkpoint is a
``step_N`` holding both ``tessera.json`` and ``.metadata``, so a save that dies leaves nothing a
run reads, and its leftovers are removed by the next save of that step. Removing an old
checkpoint (``checkpoint.keep``) deletes its marker first.

Credentials come the standard way of each store (for S3, botocore's: ``AWS_ACCESS_KEY_ID`` /
``AWS_PROFILE`` / instance roles, and ``AWS_ENDPOINT_URL`` for another endpoint such as MinIO).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import uuid

from tessera.config import ConfigError

PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "hf": "huggingface_hub"}  # the fsspec implementations that are packages of their own


def is_url(path: str) -> bool:
    return "://" in str(path)


def filesystem(path: str):
    """(fsspec filesystem, the path within it) for a URL. No cached listings: other ranks write
    into the same folders (a listing cached before rank 0 wrote tessera.json would hide it)."""
    import fsspec

    return fsspec.core.url_to_fs(path, use_listings_cache=False)


def join(root: str, *names: str) -> str:
    return posixpath.join(root, *names) if is_url(root) else os.path.join(root, *names)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


def parent(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(os.path.abspath(path))


def same_place(a: str, b: str) -> bool:
    """Whether two paths name one folder (URLs compared as written, less a trailing slash)."""
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, inner = filesystem(path)
    return fs.isfile(inner)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    return fs.isdir(inner)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


def listdir(path: str) -> list[str]:
    """The names in a folder (empty where there is none)."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, inner = filesystem(path)
    if not fs.exists(inner):
        return []
    return [posixpath.basename(p.rstrip("/")) for p in fs.ls(inner, detail=False)]


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, inner = filesystem(path)
    return fs.size(inner)


def open_file(path: str, mode: str = "rb"):
    if not is_url(path):
        return open(path, mode)
    fs, inner = filesystem(path)
    return fs.open(inner, mode)


def write_whole(path: str, data: bytes) -> None:
    """``path`` with ``data``, whole or not at all: a temporary renamed over it locally, one
    object written at once in a store (which never shows a part of one)."""
    if is_url(path):
        fs, inner = filesystem(path)
        fs.pipe_file(inner, data)
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_tree(path: str, marker: str | None = None) -> None:
    """Remove a folder and what it holds (``marker`` first, so that it stops counting at once)."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, inner = filesystem(path)
    if marker is not None and fs.exists(posixpath.join(inner, marker)):
        fs.rm(posixpath.join(inner, marker))
    if fs.exists(inner):
        fs.rm(inner, recursive=True)


def folder_bytes(path: str) -> int:
    if not is_url(path):
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    fs, inner = filesystem(path)
    return sum(fs.du(inner, total=False).values()) if fs.exists(inner) else 0


def check_store(url: str, key: str, write: bool) -> None:
    """Refuse, in words, a URL fsspec cannot open here (an unknown protocol, its package not
    installed) and, with ``write``, a place this process cannot write (no bucket, no credentials):
    a probe object written and removed."""
    protocol = url.split("://", 1)[0]
    try:
        fs, inner = filesystem(url)
    except ImportError as e:
        raise ConfigError(key, f"{url}: fsspec cannot open {protocol}:// here ({e})",
                          f"pip install {PACKAGES.get(protocol, 'the fsspec implementation of ' + protocol)}") from None
    except ValueError as e:
        raise ConfigError(key, f"{url}: {e}", "give a URL fsspec knows (s3://, gs://, file://, ...) or a local "
                          "folder") from None
    if not write:
        return
    probe = posixpath.join(inner, f".tessera-probe-{uuid.uuid4().hex}")
    try:
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001 -- each store raises its own (PermissionError, NoCredentialsError, ...)
        raise ConfigError(key, f"cannot write to {url} ({type(e).__name__}: {e})",
                          "check that the bucket exists and the store's credentials (its standard ones: for S3 "
                          "AWS_PROFILE or AWS_ACCESS_KEY_ID, and AWS_ENDPOINT_URL for another endpoint)") from None


__all__ = ["check_store", "is_url", "filesystem", "join", "basename", "parent", "same_place", "isfile", "isdir", "exists",
           "listdir", "size", "open_file", "write_whole", "remove_tree", "folder_bytes"]
