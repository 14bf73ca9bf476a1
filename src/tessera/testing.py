"""Run a function on N local ranks over gloo, with a deadline: the multi-rank test harness.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo process
group in each, calls ``fn(rank, world_size, *args)`` and returns the list of return values by
rank. If any rank raises, the others are killed and the error (with the rank's traceback) is
raised here; if they do not all finish within ``timeout`` seconds, all are killed and a
``TimeoutError`` names the ranks still running, so a hang fails fast instead of stalling CI.

Processes come from a forkserver that has imported torch once, so starting 8 ranks costs a
fork each, not 8 imports of torch. ``fn`` must be importable (defined at module level).
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

@functools.cache
def _context():
    ctx = mp.get_context("forkserver")
    # torch.testing and torch.distributed.tensor are imported lazily by assert_close and
    # DeviceMesh users: paying for them once here saves seconds per rank.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch.testing",
                                "tessera.tensor_parallel", "tessera.models"])
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, timeout, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # Plain pickle copies tensor data; the queue's own pickler would send shared-memory
        # handles that die with this process before the parent opens them.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankError(RuntimeError):
    pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, timeout, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
