"""Random streams for dropout under tensor parallelism, and seeds for initialisation.

Two streams, both owned by an :class:`RNGTracker` object (never a module global):

- the *default* stream is the device's global generator, seeded identically on every TP rank, so
  dropout on replicated activations draws the same mask everywhere;
- the *tp* stream is seeded differently per TP rank and is entered with ``tracker.fork()`` for
  dropout on TP-split activations (attention probabilities of this rank's heads, or a sequence
  slice under sequence parallelism), so each shard gets an independent mask.

``fork`` swaps the device's global RNG state in and out (dropout takes no generator argument),
exactly like Megatron's CudaRNGStatesTracker. ``get_states``/``set_states`` let activation
recomputation restore both streams so a recomputed mask equals the original.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

TP_SEED_OFFSET = 2718


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts, the same on every machine and Python run."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG states for one device; ``fork(name)`` runs a block on that stream."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def for_rank(cls, seed: int, tp_rank: int, pp_rank: int = 0,
                 device: torch.device | str = "cpu") -> "RNGTracker":
        """Seed the default stream by (seed, pp_rank) and add the ``tp`` stream by tp_rank."""
        tracker = cls(device)
        default_seed = seed + 100 * pp_rank
        torch.manual_seed(default_seed)
        tracker.add("tp", default_seed + TP_SEED_OFFSET + tp_rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream '{name}' already exists")
        # a state seeded on its own generator of this device: the global ones (of the current
        # CUDA device, or of every device for torch.manual_seed) are left untouched
        self.states[name] = torch.Generator(self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "tp"):
        if name not in self.states:
            raise KeyError(f"RNG stream '{name}' was never added")
        saved = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Snapshot of every stream, the default one under the key ``""``."""
        return {"": _get_state(self.device), **{k: v.clone() for k, v in self.states.items()}}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        _set_state(self.device, states[""])
        self.states = {k: v.clone() for k, v in states.items() if k}


def recompute(fn, *args, tracker: RNGTracker | None = None):
    """``fn(*args)`` keeping only its inputs: run again in the backward to rebuild what it saved
    (activation recomputation, Megatron's CheckpointFunction), through torch.utils.checkpoint
    (non-reentrant). torch restores the device's default stream for the rerun; the tracker's
    named streams (``tp``: dropout on TP-split activations) are put back here, as they were when
    ``fn`` first ran, and after the rerun to where the forward left them: every recomputed
    dropout mask equals the original, and later draws are unchanged."""
    from torch.utils.checkpoint import checkpoint

    def contexts():
        if tracker is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        first = dict(tracker.states)  # (fork replaces a state, never changes one in place)

        @contextlib.contextmanager
        def as_first():
            now, tracker.states = tracker.states, dict(first)
            try:
                yield
            finally:
                tracker.states = now
        return contextlib.nullcontext(), as_first()

    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)
