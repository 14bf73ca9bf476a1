"""Distributed checkpoints: a run's whole state saved by every rank in parallel as whole
(unsharded) tensors, loaded into a run of any layout (checkpoint/shards.py), visible only once
complete (checkpoint/store.py)."""

from tessera.checkpoint.checkpointer import Checkpointer
from tessera.checkpoint.store import check_resume, checkpoints, folder_gib, resume_path

__all__ = ["Checkpointer", "check_resume", "checkpoints", "folder_gib", "resume_path"]
