"""How fast this machine's disk takes a checkpoint: one process writes GIB GiB of fp32 boxes (as
many as a GPT-1.3B rank's, from the GPU where there is one) through tessera's DCP writer with
FileSystemWriter thread counts 1, 4 and 8, and reads them back.

Usage: python benchmarks/dcp_write_speed.py [GIB] [ROOT]
"""

import shutil
import sys
import time

import torch
import torch.distributed.checkpoint as tdcp

from tessera.checkpoint import dcp
from tessera.checkpoint.shards import Shard

gib, root = float(sys.argv[1]) if len(sys.argv) > 1 else 14.7, sys.argv[2] if len(sys.argv) > 2 else "/tmp/dcp_speed"
device = "cuda" if torch.cuda.is_available() else "cpu"
n = 300
per = int(gib * 2**30 / 4 / n)
shards = [Shard(f"t{i}", (per,), (0,), torch.randn(per, device=device)) for i in range(n)]
real = tdcp.FileSystemWriter
for threads in (1, 4, 8):
    shutil.rmtree(root, ignore_errors=True)
    tdcp.FileSystemWriter = lambda path, **kw: real(path, thread_count=threads)  # noqa: E731
    began = time.perf_counter()
    dcp.write(root, shards, {})
    wrote = time.perf_counter() - began
    targets = [Shard(s.key, s.shape, s.offsets, torch.empty_like(s.tensor)) for s in shards]
    began = time.perf_counter()
    dcp.read(root, targets, {})
    read = time.perf_counter() - began
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(shards, targets))
    print(f"RESULT {gib:.1f} GiB from {device}, thread_count={threads}: write {wrote:.1f} s "
          f"({gib / wrote:.2f} GiB/s), read {read:.1f} s ({gib / read:.2f} GiB/s)", flush=True)
tdcp.FileSystemWriter = real
shutil.rmtree(root, ignore_errors=True)
