"""Writing and reading :class:`~tessera.checkpoint.shards.Shard` boxes with
torch.distributed.checkpoint (DCP).

DCP writes each rank's items in parallel (one file per rank), records every tensor's global
shape and the boxes it was saved in (``.metadata``, written by rank 0 once all ranks wrote), and
on load computes, for each box a rank asks for, the overlapping saved boxes to read: resharding.
Its stock state dicts describe a rank's part of a tensor as a DTensor or ShardedTensor; a
distributed optimizer's flat shard is neither (it starts and ends mid-row), so these two
planners hand DCP the boxes directly, as write and read items, and resolve them to the views of
live storage. Everything else in the state dict (small Python objects) goes through DCP's
default handling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tessera.checkpoint.files import is_url
from tessera.checkpoint.shards import Shard


# files each rank writes at once: 4 write almost twice as fast as 1, 8 no faster than 4
# (BENCHMARKS.md, Checkpoints)
WRITE_THREADS = 4


def _chunk(shard: Shard) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(shard.offsets), sizes=shard.tensor.shape)


class _Boxes:
    """What both planners share: this rank's boxes, found by a metadata index (key, offsets)."""

    def __init__(self, shards: list[Shard]):
        super().__init__()
        self.shards = {(s.key, tuple(s.offsets)): s for s in shards}

    def _box(self, index: MetadataIndex) -> Shard | None:
        return self.shards.get((index.fqn, tuple(index.offset or ())))


class _SavePlanner(_Boxes, DefaultSavePlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(s.key, torch.Size(s.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=_chunk(s), properties=TensorProperties.create_from_tensor(s.tensor),
                                                       size=torch.Size(s.shape)))
                 for s in self.shards.values()]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item):
        shard = self._box(write_item.index)
        if shard is not None and write_item.type == WriteItemType.SHARD:
            return shard.tensor.detach().contiguous()
        return super().resolve_data(write_item)


class _LoadPlanner(_Boxes, DefaultLoadPlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        saved = self.metadata.state_dict_metadata
        for shard in self.shards.values():
            md = saved.get(shard.key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointMismatch(f"the checkpoint has no tensor {shard.key}")
            if tuple(md.size) != tuple(shard.shape):
                raise CheckpointMismatch(f"the checkpoint's {shard.key} is {list(md.size)}, this model's {list(shard.shape)}")
            items.extend(create_read_items_for_chunk_list(shard.key, md, [_chunk(shard)]))
        return dataclasses.replace(plan, items=plan.items + items)

    def resolve_tensor(self, read_item):
        shard = self._box(read_item.dest_index)
        if shard is None:
            return super().resolve_tensor(read_item)
        view = shard.tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the model it is loaded into."""


@contextlib.contextmanager
def _one_process():
    """DCP warns that it assumes one process where no process group exists: that is the intent."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _writer(path: str):
    """DCP's writer for a folder, or for an object store's URL (checkpoint/files.py) its fsspec one."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # (torch keeps it private)

        return FsspecWriter(path, thread_count=WRITE_THREADS)
    return dcp.FileSystemWriter(path, thread_count=WRITE_THREADS)


def _reader(path: str):
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    return dcp.FileSystemReader(path)


def write(path: str, shards: list[Shard], objects: dict, group=None) -> None:
    """Every rank's ``shards`` and ``objects`` (small picklable values; a key on several ranks
    is written once) into the folder ``path``. Collective over ``group`` (default: the default
    group, if any)."""
    with _one_process():
        dcp.save(dict(objects), storage_writer=_writer(path),
                 planner=_SavePlanner(shards), process_group=group)


def read(path: str, shards: list[Shard], objects: dict) -> dict:
    """Fill ``shards``' views from the checkpoint at ``path``; returns ``objects`` with each key's
    saved value. Collective over the default group, if any."""
    state = dict(objects)
    with _one_process():
        dcp.load(state, storage_reader=_reader(path), planner=_LoadPlanner(shards))
    return state


def saved_tensors(path: str) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's tensors: their whole shapes and dtypes."""
    md = _reader(path).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def storage_extents(path: str) -> dict[str, int]:
    """Each data file the checkpoint's index names, and the byte its items end at."""
    ends: dict[str, int] = {}
    for info in _reader(path).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def saved_keys(path: str) -> set[str]:
    return set(_reader(path).read_metadata().state_dict_metadata)


def read_whole(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose keys start with ``prefix``, whole, in this one process
    (e.g. ``model.layers.0.attn.qkv.weight``, fp32, as a tp=1 model holds it)."""
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in saved_tensors(path).items() if k.startswith(prefix)}
    with _one_process():
        dcp.load(state, storage_reader=_reader(path))
    return state


__all__ = ["write", "read", "read_whole", "saved_keys", "saved_tensors", "storage_extents", "CheckpointMismatch"]
