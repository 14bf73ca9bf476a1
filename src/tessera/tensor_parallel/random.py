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


# -- selective recomputation: which ops' outputs a recomputed layer keeps ---------------------------
def _attention_ops() -> set:
    """The attention kernels SDPA and varlen attention dispatch to (those this torch has)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward", "_cudnn_attention_forward")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    varlen = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn", None)
    return ops | ({varlen.default} if varlen is not None else set())


class SelectivePolicy:
    """What ``train.recompute=selective`` keeps of a layer (a policy of torch's selective activation
    checkpointing, called for every op the layer's forward dispatches): the outputs of the GEMMs
    (``mm``, ``addmm``, ``_scaled_mm``: the linear layers, whose FLOPs dominate a layer) and of the
    attention kernel (``attention``; its FLOPs grow with the sequence). Everything else runs again
    in the backward: norms, RoPE, activations, dropout, residual adds, copies, the TP collectives
    (in-place c10d calls, which a cache could not stand for). Batched ``bmm`` is not kept: it is
    reference attention's s x s scores. Never kept: an attention kernel that draws dropout, so
    every random op runs again in its order and draws the mask it drew the first time.
    ``attention=False`` (context parallelism): ring attention calls the kernel once per K/V block,
    and keeping every block's output would hold cp times a layer's attention output."""

    def __init__(self, attention: bool = True):
        from torch.utils.checkpoint import CheckpointPolicy

        aten = torch.ops.aten
        self.save, self.recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
        self.gemms = {aten.mm.default, aten.addmm.default}
        if hasattr(aten, "_scaled_mm"):
            self.gemms.add(aten._scaled_mm.default)
        self.attention = _attention_ops() if attention else set()

    def __call__(self, ctx, op, *args, **kwargs):
        if op in self.gemms:
            return self.save
        if op in self.attention and not _dropout_p(op, args, kwargs):
            return self.save
        return self.recompute


def _dropout_p(op, args, kwargs) -> float:
    """The ``dropout_p`` an attention op was called with (0 where it has none)."""
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return 0.0
    i = names.index("dropout_p")
    return float(args[i] if i < len(args) else kwargs.get("dropout_p", 0.0))


class _Recomputed(torch.autograd.Function):
    """Full recomputation as one autograd node (Megatron's CheckpointFunction): the forward runs
    ``fn`` without grad and keeps its input alone; the backward puts the RNG streams and autocast
    back as the forward found them, runs ``fn`` again with grad, back-propagates through it, and
    puts the streams back where they were. One node per layer, where torch's non-reentrant
    checkpoint runs Python hooks for every tensor the layer saves (the host's time: BENCHMARKS.md,
    Memory and recomputation)."""

    @staticmethod
    def forward(ctx, fn, tracker, x, *rest):
        ctx.fn, ctx.tracker, ctx.rest, ctx.device = fn, tracker, rest, x.device
        ctx.states = _streams(tracker, x.device)
        kind = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x, *rest)

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        x = saved.detach().requires_grad_(True)
        now = _streams(ctx.tracker, ctx.device)
        _put_streams(ctx.tracker, ctx.device, ctx.states)
        try:
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                out = ctx.fn(x, *ctx.rest)
        finally:
            _put_streams(ctx.tracker, ctx.device, now)
        torch.autograd.backward(out, grad)
        return (None, None, x.grad, *(None for _ in ctx.rest))


def _streams(tracker: RNGTracker | None, device: torch.device) -> dict[str, torch.Tensor]:
    return tracker.get_states() if tracker is not None else {"": _get_state(device)}


def _put_streams(tracker: RNGTracker | None, device: torch.device, states: dict[str, torch.Tensor]) -> None:
    if tracker is not None:
        tracker.set_states(states)
    else:
        _set_state(device, states[""])


def recompute(fn, x, *rest, tracker: RNGTracker | None = None, policy: SelectivePolicy | None = None):
    """``fn(x, *rest)`` keeping only its input ``x``, run again in the backward to rebuild what it
    saved (activation recomputation); ``rest`` holds no tensor that needs a gradient. Full
    (``policy`` None): one autograd node, ``_Recomputed`` (where ``x`` needs a gradient).
    Selective, or an ``x`` that needs none: torch.utils.checkpoint
    (non-reentrant) with the policy, which keeps the outputs of the ops it names, the rerun taking
    them from there (torch's selective activation checkpointing); torch restores the device's
    default stream for the rerun and the tracker's named streams (``tp``: dropout on TP-split
    activations) are put back here, as they were when ``fn`` first ran, and after the rerun to
    where the forward left them. Either way every recomputed dropout mask equals the original,
    and later draws are unchanged."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in rest):
        raise ValueError("recompute keeps the gradient of its first argument alone: the others must not need one")
    if policy is None and x.requires_grad:  # (else the node would not be in the graph: the layer's
        return _Recomputed.apply(fn, tracker, x, *rest)  # weights are not its inputs)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def contexts():
        first_run, rerun = (create_selective_checkpoint_contexts(policy) if policy is not None
                            else (contextlib.nullcontext(), contextlib.nullcontext()))
        if tracker is None:
            return first_run, rerun
        first = dict(tracker.states)  # (fork replaces a state, never changes one in place)

        @contextlib.contextmanager
        def as_first():
            now, tracker.states = tracker.states, dict(first)
            try:
                with rerun:
                    yield
            finally:
                tracker.states = now
        return first_run, as_first()

    return checkpoint(fn, x, *rest, use_reentrant=False, context_fn=contexts)
