"""Checksums of a checkpoint's files: taken at save, checked before a load reads them.

A file of the right size can still hold the wrong bytes (a copy cut and padded, a disk's or a
network file system's corruption), and torch.distributed.checkpoint then fails deep in
``torch.load`` (an UnpicklingError advising ``weights_only=False``), or worse, loads garbage
numbers without a word. So each data file's CRC-32 goes into ``tessera.json`` at save, and a
load checks them first, naming the file that differs.

The cost is one more pass over each file, made cheap three ways: each rank checksums the files
it wrote itself (DCP names them ``__{rank}_{n}.distcp``), right after writing them, while they
are in the page cache; a rank's files are read in parallel threads (zlib's crc32 lets go of the
GIL on large blocks); and a load spreads the check over the ranks, each reading ``1/world`` of the
files. The background save (checkpoint.async_save) checksums in its own thread.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

from tessera.checkpoint import files

BLOCK = 16 * 2**20  # bytes read at a time
THREADS = 4
METADATA = ".metadata"


def crc32(path: str) -> str:
    """The file's CRC-32 (zlib's), as 8 hex digits (streamed from an object store: one more
    download of it)."""
    crc = 0
    with files.open_file(path, "rb") as f:
        while block := f.read(BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def checksums(folder: str, names: list[str]) -> dict[str, str]:
    """``names`` (files in ``folder``) and their CRC-32s, several files at once."""
    if not names:
        return {}
    with ThreadPoolExecutor(min(THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: crc32(files.join(folder, name)), names)))


def written_by(folder: str, rank: int, world: int) -> list[str]:
    """The files of a just-written checkpoint folder that rank ``rank`` of ``world`` checksums:
    the data files it wrote (DCP's ``__{rank}_*``), and on rank 0 the index and any file no
    rank's name claims."""
    names = sorted(files.listdir(folder))
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    if rank == 0:
        claimed = {n for n in names for r in range(world) if n.startswith(f"__{r}_")}
        mine += [n for n in names if n not in claimed and (n == METADATA or n.endswith(".distcp"))]
    return mine


def differing(folder: str, expected: dict[str, str], rank: int = 0, world: int = 1) -> list[str]:
    """Of the files ``expected`` names, those this rank checks (every ``world``-th) that are
    missing or whose CRC-32 differs, each as "NAME (why)"."""
    names = sorted(expected)[rank::world]
    found = [n for n in names if files.isfile(files.join(folder, n))]
    sums = checksums(folder, found)
    return [f"{n} (missing)" if n not in sums else f"{n} (CRC-32 {sums[n]}, saved as {expected[n]})"
            for n in names if sums.get(n) != expected[n]]


__all__ = ["crc32", "checksums", "written_by", "differing"]
