"""What a forward keeps for its backward, measured: :func:`kept_bytes`.

Every storage an op allocates while ``fn()`` runs is watched through a weak reference
(a ``TorchDispatchMode`` sees every op, inside autograd functions and recomputed regions too);
those still alive once ``fn`` has returned are what the forward left for the backward: tensors
autograd saved, a recomputed region's inputs, the outputs selective recomputation keeps, and
whatever ``fn`` returns. Views and in-place results share their input's storage and are not
counted again; parameters and inputs allocated before ``fn`` are not counted at all. Unlike
``saved_tensors_hooks``, which a checkpointed region replaces with its own, this sees every mode
of ``train.recompute`` alike.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class _NewStorages(TorchDispatchMode):
    """Weak references to the storages the ops allocate (by address; an address freed and reused
    takes the newer storage)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = _storages((args, kwargs))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            address, old = storage.data_ptr(), self.refs.get(storage.data_ptr())
            if address not in given and storage.nbytes() and (old is None or old[0]() is None):
                self.refs[address] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.refs.values() if ref() is not None)


def kept_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the storages allocated while ``fn()`` runs that are still alive after it (keep
    what ``fn`` returns somewhere of yours, and subtract it, to count only what autograd keeps)."""
    mode = _NewStorages()
    with mode:
        fn()
    return mode.alive()


__all__ = ["kept_bytes"]
