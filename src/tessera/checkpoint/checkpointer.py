"""Saving a training run's whole state, and loading it into a run of any layout.

What a checkpoint holds (checkpoint/store.py for the files):

- the fp32 main parameters and Adam's moments as whole tensors, each rank writing its boxes
  (checkpoint/shards.py), and Adam's step count;
- the step, the batch calculator's position (consumed samples: the data resumes where it
  stopped), the learning-rate schedule's settings, the fp16 loss scaler's state, the config;
- each (tp rank, pp rank)'s random streams (dropout): restored where the loading run has the
  same layout (tp, pp, vpp, dp), otherwise the loading run's own seeds stand.

The 16-bit model is not saved: it is the main parameters rounded, as the optimizer makes it
after every step. A resumed run on the same layout continues bit for bit (tests/test_checkpoint.py).
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.checkpoint import dcp, store
from tessera.checkpoint.shards import optimizer_shards
from tessera.config import Config, to_dict
from tessera.tensor_parallel import RNGTracker
from tessera.topology import Topology


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value, src: int = 0):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Checkpointer:
    """One rank's view of the run's state, for :meth:`save` and :meth:`load` (collectives: every
    rank calls them alike)."""

    def __init__(self, cfg: Config, topo: Topology, chunks, data_parallel, optimizer, rng: RNGTracker | None):
        self.cfg, self.topo, self.chunks = cfg, topo, chunks
        self.data_parallel, self.optimizer, self.rng = data_parallel, optimizer, rng
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # the dp replicas share their streams; a run of another layout draws in another order
        self._rng_key = (f"rng.tp{topo.tp_rank}_of_{topo.tp}.pp{topo.pp_rank}_of_{topo.pp}"
                         f".vpp{cfg.parallel.vpp}.dp{topo.dp}")

    def _shards(self, moments: dict[Tensor, tuple[Tensor, Tensor]], saving: bool):
        t = self.topo
        return optimizer_shards(self.chunks, self.optimizer, self.cfg.model.vocab_size, t.tp_rank, t.dp_rank,
                                t.dp, moments, saving=saving)

    def _adam_step(self) -> float:
        for state in self.optimizer.inner.state.values():
            if "step" in state:
                return float(state["step"])
        return 0.0

    def save(self, step: int, scheduler, data_feed, scaler) -> str:
        """Write the state after ``step`` optimizer steps to ``checkpoint.dir/step_N``; returns
        that folder."""
        self.data_parallel.wait_param_gather()  # (a zero 1/2 gather still writing into the buffers)
        inner = self.optimizer.inner
        moments = {}
        for tensor in self.optimizer.tensors:
            state = inner.state.get(tensor, {})
            moments[tensor] = (state["exp_avg"], state["exp_avg_sq"]) if "exp_avg" in state else \
                (torch.zeros_like(tensor), torch.zeros_like(tensor))
        objects = {}
        if self.rng is not None and self.topo.dp_rank == 0:
            buf = io.BytesIO()
            torch.save(self.rng.get_states(), buf)
            objects[self._rng_key] = buf.getvalue()
        partial = store.begin_save(self.cfg.checkpoint.dir, step) if self.rank == 0 else None
        partial = _broadcast(partial)
        _barrier()  # (the folder exists before any rank writes into it)
        dcp.write(partial, self._shards(moments, saving=True), objects)
        final = None
        if self.rank == 0:
            p, t = self.cfg.parallel, self.topo
            meta = {"step": step, "adam_step": self._adam_step(), "batches": data_feed.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None,
                    "layout": {"tp": t.tp, "pp": t.pp, "dp": t.dp, "vpp": p.vpp, "zero": p.zero,
                               "dtype": self.cfg.train.dtype},
                    "config": to_dict(self.cfg)}
            final = store.finish_save(partial, meta, self.cfg.checkpoint.keep)
        return _broadcast(final)

    def load(self, path: str, scheduler, data_feed, scaler) -> tuple[int, bool]:
        """Load the checkpoint at ``path`` into this run (any layout); returns (its step, whether
        the random streams were restored)."""
        meta = store.read_meta(path)
        moments = {tensor: (torch.zeros_like(tensor), torch.zeros_like(tensor)) for tensor in self.optimizer.tensors}
        objects = {self._rng_key: b""} if self.rng is not None and self._rng_key in dcp.saved_keys(path) else {}
        loaded = dcp.read(path, self._shards(moments, saving=False), objects)
        self.optimizer.load_checkpoint(moments, meta["adam_step"])
        scheduler.load_state_dict(meta["scheduler"])
        data_feed.load_state_dict(meta["batches"])
        if scaler is not None and meta.get("scaler") is not None:
            scaler.load_state_dict(meta["scaler"])
        if objects:
            self.rng.set_states(torch.load(io.BytesIO(loaded[self._rng_key]), weights_only=True))
        return meta["step"], bool(objects)


__all__ = ["Checkpointer"]
