"""Saving a training run's whole state, and loading it into a run of any layout.

What a checkpoint holds (checkpoint/store.py for the files):

- the fp32 main parameters and Adam's moments as whole tensors, each rank writing its boxes
  (checkpoint/shards.py), and Adam's step count;
- the step, the batch calculator's position (consumed samples: the data resumes where it
  stopped), the learning-rate schedule's settings, the fp16 loss scaler's state, the numerics
  guard's spike window, the config;
- each (tp rank, pp rank)'s random streams (dropout): restored where the loading run has the
  same layout (tp, pp, vpp, dp), otherwise the loading run's own seeds stand.

The 16-bit model is not saved: it is the main parameters rounded, as the optimizer makes it
after every step. A resumed run on the same layout continues bit for bit (tests/test_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import pickle
import threading
import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from tessera.checkpoint import checksums, dcp, store
from tessera.checkpoint.shards import optimizer_shards
from tessera.config import Config, to_dict
from tessera.tensor_parallel import RNGTracker
from tessera.topology import Topology


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def _broadcast(value, src: int = 0):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Checkpointer:
    """One rank's view of the run's state, for :meth:`save` and :meth:`load` (collectives: every
    rank calls them alike).

    ``checkpoint.async_save``: :meth:`save` copies this rank's boxes into host memory (pinned,
    kept for the next save) and returns; a thread of its own writes them, over a gloo group of
    its own (the training's collectives go on on theirs), and rank 0 renames the folder into
    place when every rank has written. The next save, or :meth:`wait`, waits for it first and
    raises its error. A run that dies meanwhile leaves ``step_N.partial``, never read."""

    def __init__(self, cfg: Config, topo: Topology, chunks, data_parallel, optimizer, rng: RNGTracker | None,
                 log=print):
        self.cfg, self.topo, self.chunks = cfg, topo, chunks
        self.data_parallel, self.optimizer, self.rng, self.log = data_parallel, optimizer, rng, log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # the dp (and cp) replicas share their streams; a run of another layout draws in another order
        self._rng_key = (f"rng.tp{topo.tp_rank}_of_{topo.tp}.pp{topo.pp_rank}_of_{topo.pp}"
                         f".vpp{cfg.parallel.vpp}.dp{topo.dp}" + (f".cp{topo.cp}" if topo.cp > 1 else ""))
        if topo.heterogeneous:  # (streams restored on the same stage grids only)
            grid = topo.grid
            self._rng_key += ".stage_tp" + "_".join(map(str, grid.stage_tp)) + ".stage_dp" + "_".join(map(str, grid.stage_dp))
        self.background = cfg.checkpoint.async_save and bool(cfg.checkpoint.dir)
        self._group = None
        if self.background and dist.is_initialized():  # (made on every rank alike: the config is the same)
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.train.timeout_s))
        self._staged: dict[tuple, Tensor] = {}
        self._pending: tuple[threading.Thread, dict] | None = None

    def _shards(self, moments: dict[Tensor, tuple[Tensor, Tensor]], saving: bool):
        t = self.topo
        return optimizer_shards(self.chunks, self.optimizer, self.cfg.model.vocab_size, t.tp_rank, t.dp_cp_rank,
                                t.dp_cp, moments, saving=saving)

    def _adam_step(self) -> float:
        for state in self.optimizer.inner.state.values():
            if "step" in state:
                return float(state["step"])
        return 0.0

    def save(self, step: int, scheduler, data_feed, scaler, guard=None) -> str:
        """Write the state after ``step`` optimizer steps to ``checkpoint.dir/step_N`` (in the
        background with ``checkpoint.async_save``); returns that folder. ``guard``: the
        NumericsGuard, whose state (the spike window) goes along."""
        self.wait()
        began = time.perf_counter()
        self.data_parallel.wait_param_gather()  # (a zero 1/2 gather still writing into the buffers)
        inner = self.optimizer.inner
        moments = {}
        for tensor in self.optimizer.tensors:
            state = inner.state.get(tensor, {})
            moments[tensor] = (state["exp_avg"], state["exp_avg_sq"]) if "exp_avg" in state else \
                (torch.zeros_like(tensor), torch.zeros_like(tensor))
        objects = {}
        if self.rng is not None and self.topo.dp_cp_rank == 0:
            buf = io.BytesIO()
            torch.save(self.rng.get_states(), buf)
            objects[self._rng_key] = buf.getvalue()
        meta = None
        if self.rank == 0:
            p, t = self.cfg.parallel, self.topo
            meta = {"step": step, "adam_step": self._adam_step(), "batches": data_feed.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None,
                    "numerics": guard.state_dict() if guard is not None else None,
                    "layout": {"tp": t.tp, "cp": t.cp, "pp": t.pp, "dp": t.dp, "vpp": p.vpp, "zero": p.zero,
                               "dtype": self.cfg.train.dtype,
                               **({"stage_tp": list(p.stage_tp), "stage_dp": list(p.stage_dp)} if t.heterogeneous else {})},
                    "config": to_dict(self.cfg)}
        partial = _broadcast(store.begin_save(self.cfg.checkpoint.dir, step) if self.rank == 0 else None)
        _barrier()  # (the folder exists before any rank writes into it)
        shards = self._shards(moments, saving=True)
        if not self.background:
            return self._write(partial, shards, objects, meta, began, None)
        shards = [dataclasses.replace(s, tensor=self._stage(s)) for s in shards]
        if any(s.tensor.is_pinned() for s in shards):
            torch.cuda.synchronize()  # (the copies into pinned memory are asynchronous)
        self.log(f"tessera: saving {partial.removesuffix('.partial')} in the background "
                 f"(copied to host memory in {time.perf_counter() - began:.1f} s)")
        result: dict = {}
        thread = threading.Thread(target=self._write_in_background, daemon=True, name="tessera-checkpoint",
                                  args=(partial, shards, objects, meta, began, result))
        thread.start()
        self._pending = (thread, result)
        return partial.removesuffix(".partial")

    def _stage(self, shard) -> Tensor:
        """A host copy of one box, in a buffer kept for the next save."""
        key = (shard.key, shard.offsets)
        buf = self._staged.get(key)
        if buf is None or buf.shape != shard.tensor.shape:
            buf = torch.empty(shard.tensor.shape, dtype=shard.tensor.dtype,
                              pin_memory=shard.tensor.is_cuda)
            self._staged[key] = buf
        buf.copy_(shard.tensor, non_blocking=shard.tensor.is_cuda)
        return buf

    def _write(self, partial: str, shards, objects: dict, meta: dict | None, began: float, group) -> str:
        dcp.write(partial, shards, objects, group)
        sums = self._checksums(partial, group)
        final = partial.removesuffix(".partial")
        if meta is not None:  # rank 0, once every rank has written (DCP's save ends with a collective)
            store.finish_save(partial, meta | {"checksums": sums}, self.cfg.checkpoint.keep)
        _barrier(group)  # (renamed before any rank says so)
        self.log(f"tessera: saved {final} ({store.folder_gib(final):.2f} GiB in {time.perf_counter() - began:.1f} s)")
        return final

    @staticmethod
    def _checksums(partial: str, group) -> dict[str, str] | None:
        """Every rank the CRC-32s of the files it wrote, gathered: rank 0 gets them all (None elsewhere)."""
        if not dist.is_initialized():
            return checksums.checksums(partial, checksums.written_by(partial, 0, 1))
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine = checksums.checksums(partial, checksums.written_by(partial, rank, world))
        every = [None] * world if rank == 0 else None
        dist.gather_object(mine, every, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return {name: crc for part in every for name, crc in part.items()} if rank == 0 else None

    def _write_in_background(self, partial, shards, objects, meta, began, result: dict) -> None:
        try:
            result["path"] = self._write(partial, shards, objects, meta, began, self._group)
        except BaseException as e:  # raised in the training's thread by wait()
            result["error"] = e

    @contextlib.contextmanager
    def finishing(self):
        """Around the training loop: where it raises (a later step's error, Ctrl-C), a background
        save still writing is finished first, so the checkpoint it was taking is not lost with
        the process (its own error, if any, gives way to the loop's)."""
        try:
            yield
        except BaseException:
            if self._pending is not None:
                self.log("tessera: finishing the background checkpoint save before stopping")
                with contextlib.suppress(Exception):
                    self.wait()
            raise

    def wait(self) -> str | None:
        """Wait for a background save; returns its folder (None if there was none), or raises
        what it raised."""
        if self._pending is None:
            return None
        thread, result = self._pending
        self._pending = None
        thread.join()
        if "error" in result:
            raise RuntimeError(f"the background checkpoint save failed: {result['error']}") from result["error"]
        return result["path"]

    def load(self, path: str, scheduler, data_feed, scaler, weights_only: bool = False, guard=None) -> tuple[int, bool]:
        """Load the checkpoint at ``path`` into this run (any layout); returns (the step to go on
        from, whether the random streams were restored). ``weights_only``: the parameters only
        (a fine-tune): Adam afresh, step 0, the data, schedules and streams as this run starts them."""
        meta = store.read_meta(path)
        self._verify(path, meta.get("checksums"))
        moments = {tensor: (torch.zeros_like(tensor), torch.zeros_like(tensor)) for tensor in self.optimizer.tensors}
        shards = self._shards(moments, saving=False)
        if weights_only:
            shards = [s for s in shards if s.key.startswith("model.")]
        wanted = not weights_only and self.rng is not None and self._rng_key in dcp.saved_keys(path)
        objects = {self._rng_key: b""} if wanted else {}
        try:
            loaded = dcp.read(path, shards, objects)
        except dcp.CheckpointMismatch as e:  # (check_resume compares tessera.json with the tensors first)
            raise store.damaged(self.cfg, path, f"its tensors do not fit its {store.META}'s model: {e}") from None
        except CheckpointException as e:  # (a checkpoint saved without checksums, which would name the file)
            inner = next(iter(e.failures.values()), (e,))[0]
            first = (str(inner).strip().splitlines() or [""])[0][:200]
            raise store.damaged(self.cfg, path, f"its data files do not load ({type(inner).__name__}: {first}; saved "
                                "without checksums, which would name the file)") from None
        self.optimizer.load_checkpoint(moments, 0.0 if weights_only else meta["adam_step"])
        if weights_only:
            return 0, False
        if not self.cfg.checkpoint.new_schedule:  # (else this run's own, from the resumed step on)
            scheduler.load_state_dict(meta["scheduler"])
        data_feed.load_state_dict(meta["batches"])
        if scaler is not None and meta.get("scaler") is not None:
            scaler.load_state_dict(meta["scaler"])
        if guard is not None:
            guard.load_state_dict(meta.get("numerics"))  # (None in checkpoints older than the guard, 2026-11-29)
        if objects:
            try:
                states = torch.load(io.BytesIO(loaded[self._rng_key]), weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError) as e:  # (a checkpoint saved without checksums)
                raise store.damaged(self.cfg, path, f"its random streams ({self._rng_key}) do not unpickle "
                                    f"({type(e).__name__})") from None
            self.rng.set_states(states)
        return meta["step"], bool(objects)

    def _verify(self, path: str, expected: dict[str, str] | None) -> None:
        """The checkpoint's files against the CRC-32s saved with it (none in checkpoints saved before
        2026-12-01), each rank a share of the files; every rank refuses a mismatch alike."""
        if not expected:
            return
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        bad = checksums.differing(path, expected, rank, world)
        if world > 1:
            every: list = [None] * world
            dist.all_gather_object(every, bad)
            bad = [b for part in every for b in part]
        if bad:
            raise store.damaged(self.cfg, path, f"{bad[0]} fails its checksum"
                                + (f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""))


__all__ = ["Checkpointer"]
