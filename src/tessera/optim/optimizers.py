"""AdamW over fp32 main parameters: Megatron's mixed-precision and distributed optimizers in one
class (zero 0-2), and the FSDP one (zero 3).

:class:`MainParamOptimizer` updates, for every bucket of the data-parallel buffers, the range
this rank owns: the whole bucket (zero=0) or this rank's 1/dp shard (zero 1/2, ZeRO-1/2).

- fp32 model: the main parameters are the model's buffer slices themselves (no copy).
  bf16/fp16 model: an fp32 copy of the range, cast back into the model's buffer after each step
  (DataParallel then all-gathers the shards for zero >= 1).
- Each parameter's part of a range is its own optimizer tensor (a view of the range), so
  matrices get weight decay and vectors (norms, biases) do not, and the gradient norm counts
  each part by its parameter's rule (tessera.optim.clip).
- ``offload`` (``parallel.optimizer_offload``): the main parameters are fp32 copies in host
  memory (pinned where CUDA is present), Adam's moments with them, and AdamW runs on the CPU
  (torch's fused CPU kernel, multi-threaded). A step brings the reduced fp32 gradients down span
  by span through two pinned staging buffers (tessera.optim.offload), updates each span as its
  copy lands while the next one is copied, and copies the parameters back (through an fp32
  device buffer, cast on the GPU, for a 16-bit model). Finalize, unscaling and the norm still
  work on the device gradients.

Both classes present the same face to the training step: ``grads()`` (this rank's fp32
gradients with the parameter each belongs to, ready for finalize, unscaling and clipping),
``step()``, ``zero_grad()``, ``param_groups`` (for the LR schedule) and ``sharded`` (whether
those gradients are dp shards, which the norm must sum over dp).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tessera.config import OptimConfig
from tessera.distributed.data_parallel import DataParallel
from tessera.optim.offload import staging_buffers, staging_spans


def _adamw(groups: list[dict], cfg: OptimConfig, on_cuda: bool, fused: bool = False) -> torch.optim.AdamW:
    """Fused on CUDA (or where asked: the offloaded update's CPU kernel), foreach elsewhere."""
    fused = on_cuda or fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None, foreach=None if fused else True)


def _decay_groups(pieces: list[tuple[Tensor, nn.Parameter]], cfg: OptimConfig) -> list[dict]:
    decay = [t for t, p in pieces if p.ndim >= 2]
    no_decay = [t for t, p in pieces if p.ndim < 2]
    # "decays": the group the weight-decay schedule sets (optim/scheduler.py), also where the
    # schedule starts at 0 or optim.weight_decay (the constant style's value) is 0
    return [{"params": decay, "weight_decay": cfg.weight_decay, "decays": True},
            {"params": no_decay, "weight_decay": 0.0, "decays": False}]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard (FSDP), else itself


class _AdamW:
    """What both optimizers share: the AdamW they drive and its state."""

    inner: torch.optim.AdamW

    def _build(self, pieces: list[tuple[Tensor, nn.Parameter]], cfg: OptimConfig, fused: bool = False) -> None:
        """``pieces``: (tensor AdamW updates, the model parameter it stands for)."""
        self.tensors = [t for t, _ in pieces]
        self.inner = _adamw(_decay_groups(pieces, cfg), cfg, bool(pieces) and pieces[0][0].is_cuda, fused)

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's groups, where the LR schedule writes (read through: ``load_state_dict``
        replaces them)."""
        return self.inner.param_groups

    def state_bytes(self) -> int:
        """Bytes of optimizer state (Adam's two moments) on this rank; before the first step, what
        they will take."""
        allocated = sum(_local(t).numel() * t.element_size() for s in self.inner.state.values()
                        for t in s.values() if torch.is_tensor(t) and t.ndim > 0)
        return allocated or 2 * 4 * sum(_local(t).numel() for t in self.tensors)

    def _adam_step(self, skip: Tensor | None) -> None:
        """AdamW's step, left out where ``skip`` (a bool tensor) is set: the fused kernel (CUDA)
        reads it on the device as its ``found_inf`` and changes nothing, step count included;
        the foreach one (CPU) has no such input, so the host reads the flag (no wait off CUDA)."""
        if skip is None:
            self.inner.step()
        elif self.inner.defaults.get("fused"):
            self.inner.found_inf = skip.float()
            try:
                self.inner.step()
            finally:
                self.inner.found_inf = None
        elif not skip.item():
            self.inner.step()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def load_checkpoint(self, moments: dict[Tensor, tuple[Tensor, Tensor]], step: float) -> None:
        """After a checkpoint's main parameters were read into place: Adam's state from its
        moments (each optimizer tensor's exp_avg and exp_avg_sq) and step count."""
        order = [t for group in self.inner.param_groups for t in group["params"]]  # state_dict's numbering
        state = {i: {"step": torch.tensor(float(step)), "exp_avg": moments[t][0], "exp_avg_sq": moments[t][1]}
                 for i, t in enumerate(order)}
        self.inner.load_state_dict({"state": state, "param_groups": self.inner.state_dict()["param_groups"]})


def _host(like: Tensor, pin: bool) -> Tensor:
    """An fp32 host tensor of ``like``'s length, page-locked where ``pin`` (fast, asynchronous copies)."""
    return torch.empty(like.numel(), dtype=torch.float32, pin_memory=pin)


class MainParamOptimizer(_AdamW):
    """``offload_staging``: with ``offload``, the most elements a staging span holds (0: a whole range)."""

    def __init__(self, dp: DataParallel, cfg: OptimConfig, offload: bool = False, offload_staging: int = 0):
        self.dp, self.sharded, self.offload = dp, dp.sharded, offload
        self.mains: list[Tensor] = []  # one flat fp32 tensor per range
        self.pieces: list[tuple[nn.Parameter, int, int, nn.Parameter]] = []  # (tensor, range, a..b, model param)
        self.spans: list[tuple[int, int, int, list[int]]] = []  # offload: (range, a, b, its pieces' indices)
        pin = offload and torch.cuda.is_available()
        for i, rng in enumerate(dp.ranges):
            if offload:
                main = _host(rng.param, pin)
                main.copy_(rng.param)
            else:
                main = rng.param if rng.param.dtype == torch.float32 else rng.param.float()
            self.mains.append(main)
            first = len(self.pieces)
            for param, a, b in rng.fragments:
                self.pieces.append((nn.Parameter(main[a:b]), i, slice(a, b), param))
            if offload:
                where = sorted((fa, fb) for _, fa, fb in rng.fragments)
                for a, b in staging_spans(main.numel(), where, offload_staging):
                    inside = [k for k in range(first, len(self.pieces)) if a <= self.pieces[k][2].start < b]
                    self.spans.append((i, a, b, inside))
        longest = max((b - a for _, a, b, _ in self.spans), default=0)
        self.staging = [torch.empty(longest, dtype=torch.float32, pin_memory=pin)
                        for _ in range(staging_buffers(len(self.spans)))]  # offload: gradients on their way down
        self._build([(t, p) for t, _, _, p in self.pieces], cfg, fused=offload)
        # which ranges hold an fp32 copy (bf16/fp16 model) rather than the model's own storage
        self.copies = [m.data_ptr() != rng.param.data_ptr() for m, rng in zip(self.mains, dp.ranges)]

    def grads(self) -> list[tuple[Tensor, nn.Parameter]]:
        """Point every main parameter's ``.grad`` at its reduced fp32 gradient; return them
        (offload: the device gradients, which the step then copies to the host)."""
        flat = [rng.fp32_grad() for rng in self.dp.ranges]
        out = []
        for tensor, i, part, param in self.pieces:
            if not self.offload:
                tensor.grad = flat[i][part]
            out.append((flat[i][part], param))
        return out

    def step(self, grad_multiplier: Tensor | None = None, skip: Tensor | None = None) -> None:
        """AdamW on the main parameters with every gradient times ``grad_multiplier`` (the
        clipping factor; applied by the fused kernel on CUDA), then the model's copy updated;
        where ``skip`` is set, nothing changes (the copy and gather then carry the same values)."""
        if self.offload:
            self._host_step(grad_multiplier, skip)
            return
        if grad_multiplier is not None and self.inner.defaults.get("fused"):
            self.inner.grad_scale = 1.0 / grad_multiplier  # the fused kernel divides by it
        elif grad_multiplier is not None:
            torch._foreach_mul_([t.grad for t, *_ in self.pieces], grad_multiplier)
        try:
            self._adam_step(skip)
            self._copy_to_model()
            self.dp.start_param_gather()
        finally:
            self.inner.grad_scale = None

    @torch.no_grad()
    def _host_step(self, grad_multiplier: Tensor | None, skip: Tensor | None) -> None:
        """offload: span by span (tessera.optim.offload), the gradient (as finalized, unscaled, on
        the device) down while the previous span updates, AdamW on this span's parameters alone
        with the clipping factor applied by a foreach multiply (as the CPU path without offload),
        its parameters back; then the gather started."""
        if not self.spans:
            return
        cuda = self.dp.ranges[0].grad.is_cuda
        landed = [self._fetch(0, cuda)]
        if grad_multiplier is not None:
            grad_multiplier = grad_multiplier.cpu()
        skip = skip.cpu() if skip is not None else None
        for k, (i, a, b, inside) in enumerate(self.spans):
            if k + 1 < len(self.spans):
                landed.append(self._fetch(k + 1, cuda))
            if landed[k] is not None:
                landed[k].synchronize()
            staged = self.staging[k % len(self.staging)]
            for n in inside:
                tensor, _, part, _ = self.pieces[n]
                tensor.grad = staged[part.start - a:part.stop - a]
            grads = [self.pieces[n][0].grad for n in inside]
            if grad_multiplier is not None:
                torch._foreach_mul_(grads, grad_multiplier)
            self._adam_step(skip)  # (only this span's pieces have a gradient: AdamW leaves the others)
            for n in inside:
                self.pieces[n][0].grad = None
            self._copy_to_model(i, slice(a, b))
        self.dp.start_param_gather()

    def _fetch(self, k: int, cuda: bool):
        """Start span ``k``'s gradient down into its staging buffer; the event that marks it landed
        (None off CUDA, where the copy is done on return)."""
        i, a, b, _ = self.spans[k]
        self.staging[k % len(self.staging)][:b - a].copy_(self.dp.ranges[i].grad[a:b], non_blocking=cuda)
        if not cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.dp.ranges[i].grad.device))
        return event

    @torch.no_grad()
    def _copy_to_model(self, only: int | None = None, part: slice = slice(None)) -> None:
        """The updated fp32 main parameters into the model's (16-bit) buffer, where they are copies
        (offload: from the host, through an fp32 device buffer where the model is 16-bit, so that
        the cast runs on the GPU rather than the CPU); ``only``: range ``only``'s ``part`` alone."""
        for i, (main, rng, copy) in enumerate(zip(self.mains, self.dp.ranges, self.copies)):
            if not copy or (only is not None and i != only):
                continue
            main, param = main[part], rng.param[part]
            if main.device != param.device and param.dtype != torch.float32:
                main = main.to(param.device, non_blocking=True)
            param.copy_(main, non_blocking=main.is_pinned())

    def zero_grad(self) -> None:
        for tensor, *_ in self.pieces:
            tensor.grad = None

    def state_dict(self) -> dict:
        """AdamW's state, and the fp32 main parameters where they are copies of a 16-bit model's
        (``"main_params"``, by range index; Megatron's ``fp32_from_fp16_params``): a resumed run
        must continue from them, not from the 16-bit weights rounded from them. References to
        the live tensors, as torch's optimizers give."""
        state = self.inner.state_dict()
        state["main_params"] = {i: m for i, (m, copy) in enumerate(zip(self.mains, self.copies)) if copy}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore AdamW's state and the fp32 main parameters, then the model's 16-bit copy of
        them (gathered over dp where sharded). A state whose fp32 main parameters differ in
        shape or presence (an fp32 model's against a 16-bit one's, another layout or dp
        sharding) is refused before anything changes."""
        state = dict(state)
        mains = state.pop("main_params", None)
        wanted = {i: tuple(m.shape) for i, (m, copy) in enumerate(zip(self.mains, self.copies)) if copy}
        if mains is None and wanted:
            raise ValueError("this optimizer keeps fp32 main parameters (a 16-bit model) and the state has none "
                             "(saved from an fp32 model, or by an older version): resuming from it would restart "
                             "from the 16-bit weights")
        given = {int(i): tuple(m.shape) for i, m in (mains or {}).items()}
        if given != wanted:
            raise ValueError(f"the state's fp32 main parameters {given} do not fit this optimizer's {wanted} "
                             "(range index: shape): saved under another layout, parallel.zero, dp size or dtype")
        self.inner.load_state_dict(state)
        with torch.no_grad():
            for i, main in (mains or {}).items():
                self.mains[int(i)].copy_(main)
        self._mains_changed()

    def load_checkpoint(self, moments: dict[Tensor, tuple[Tensor, Tensor]], step: float) -> None:
        super().load_checkpoint(moments, step)
        self._mains_changed()

    def _mains_changed(self) -> None:
        """The model's 16-bit copy of new main parameters, gathered over dp where sharded."""
        self._copy_to_model()
        # Waited for here: left running, it would land whenever the peers get there, over a model
        # state loaded after this one (an fp32 model's main parameters are its own storage, so
        # the gather sends what each rank's shard holds at that moment).
        self.dp.start_param_gather()
        self.dp.wait_param_gather()

    def main_param_bytes(self) -> int:
        """Bytes of fp32 main parameters that are copies (not the model's own storage)."""
        return sum(m.numel() * 4 for m, copy in zip(self.mains, self.copies) if copy)


class FSDPOptimizer(_AdamW):
    """zero=3: AdamW on FSDP's fp32 DTensor shards (they are the main parameters)."""

    sharded = True

    def __init__(self, chunks: list[nn.Module], cfg: OptimConfig):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self._build([(p, p) for p in self.params], cfg)

    def grads(self) -> list[tuple[Tensor, nn.Parameter]]:
        """Each parameter's local gradient shard (zeros where a parameter got no gradient, so a
        tied embedding's two ends both join its all-reduce)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [(p.grad.to_local(), p) for p in self.params]

    def step(self, grad_multiplier: Tensor | None = None, skip: Tensor | None = None) -> None:
        if grad_multiplier is not None:
            torch._foreach_mul_([p.grad.to_local() for p in self.params], grad_multiplier)
        self._adam_step(skip)

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def main_param_bytes(self) -> int:
        return 0  # the fp32 shards are the model's parameters
