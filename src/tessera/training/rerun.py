"""Non-finite steps: never applied, and re-run to tell a bad batch from a bad machine.

A bf16/fp32 step whose global gradient norm is inf or nan would turn every weight into nan (the
clipping factor is nan), and every checkpoint saved after it would hold them. Here such a step
changes nothing: :meth:`NumericsGuard.skip` turns the norm into a flag on the device, which the
optimizers hand to the fused AdamW kernel as its ``found_inf`` (the kernel then leaves weights,
moments and step count alone; off CUDA the host reads the flag, which costs nothing there). The
host learns of it when it reads the step's figures, one step later (training/step.py), and the
training loop asks :meth:`NumericsGuard.check` what to do:

- ``train.nonfinite = "stop"``: the flag is sticky (every later step is skipped too, so the step
  launched before the host knew changed nothing either). The step's batch is run again on the
  same weights and random streams (``rerun``). Non-finite again: reproducible, the data, the
  model or the settings cause it. Finite: transient, the hardware is suspect (Megatron's rerun
  state machine, seed ``rerun_state_machine.py``, draws the same line). Either way the run stops
  with :class:`NonFiniteStop`, which names the step, its figures, the batch's samples and what
  to do.
- ``"skip"``: the step is passed over; the run stops after ``train.max_skipped_steps`` in a row.

With ``train.skip_spikes = K`` a finite step is skipped the same way (and passed over) when its
gradient norm lies more than K standard deviations above the mean of the last
``train.spike_window`` applied steps' norms (:class:`SpikeWindow`, kept on the device; OLMo 2's
remedy for loss spikes). Either policy stops after ``train.max_skipped_steps`` skips in a row.

The flag comes from the global gradient norm, which every rank holds after its all-reduce, so
every rank skips the same steps and raises the same error. fp16 runs skip overflowing steps by
dynamic loss scaling (optim/loss_scale.py); the guard leaves them to it.

``train.inject_fault_step`` corrupts one of rank 0's gradients at that step (a nan always or only
on the first run of it, or a finite spike), to try all of this on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from tessera.config import TrainConfig


OTHER_SETTINGS = ("resume from the last checkpoint with a lower optim.lr or a longer optim.warmup "
                  "(checkpoint.new_schedule=true)")


class NonFiniteStop(RuntimeError):
    """The run stopped at a non-finite step (train.nonfinite), or after train.max_skipped_steps
    skipped steps in a row; the message says what was found."""


@dataclass
class LaunchedStep:
    """What re-running a step needs: its batch (this rank's micro-batches), the random streams it
    started from, and which samples of the training stream it held."""

    step: int  # counting from 0
    micro_batches: list[dict]
    rng_states: dict | None
    samples: tuple[int, int]  # [first, end) of the global sample stream


class SpikeWindow:
    """The gradient norms of the last ``size`` applied steps, on the device: a step is a spike
    when the window is full and its norm exceeds the window's mean by more than ``sigma``
    standard deviations. Nothing here waits for the GPU."""

    def __init__(self, size: int, sigma: float, device: torch.device):
        self.size, self.sigma = size, sigma
        self.norms = torch.zeros(size, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)  # applied steps recorded

    def is_spike(self, norm: Tensor) -> Tensor:
        limit = self.norms.mean() + self.sigma * self.norms.std()
        return (self.count >= self.size) & (norm.float() > limit)

    def record(self, norm: Tensor, applied: Tensor) -> None:
        """``norm`` into the window where ``applied``; the window as it was elsewhere."""
        at = (self.count % self.size).view(1)
        self.norms.index_put_((at,), torch.where(applied, norm.float(), self.norms[at]))
        self.count += applied.long()

    def state_dict(self) -> dict:
        return {"norms": self.norms.tolist(), "count": int(self.count)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["norms"]) != self.size:  # (train.spike_window changed: start the window afresh)
            return
        self.norms.copy_(torch.tensor(state["norms"], dtype=torch.float32))
        self.count.fill_(state["count"])


class NumericsGuard:
    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int, fp16: bool = False,
                 knows_loss: bool = True, checkpoints: bool = False):
        """``knows_loss``: this rank holds the loss (the last pipeline stage); ``checkpoints``: the
        run saves checkpoints (the stop message says what became of them)."""
        self.policy, self.max_in_a_row, self.fp16 = cfg.nonfinite, cfg.max_skipped_steps, fp16
        self.knows_loss, self.checkpoints = knows_loss, checkpoints
        self.inject_step, self.inject, self.rank = cfg.inject_fault_step, cfg.inject_fault, rank
        self.spikes = SpikeWindow(cfg.spike_window, cfg.skip_spikes, device) if cfg.skip_spikes > 0 and not fp16 else None
        self.sigma = cfg.skip_spikes
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)  # "stop": set by the first bad step
        self.in_a_row = 0
        self.step: int | None = None  # the step being launched (from 0), for the injection
        self.rerunning = False

    def launching(self, step: int, rerunning: bool = False) -> None:
        self.step, self.rerunning = step, rerunning

    def poison(self, grads: list[Tensor]) -> None:
        """train.inject_fault_step: corrupt this rank's first non-empty gradient (rank 0)."""
        if self.step is None or self.step + 1 != self.inject_step or self.rank != 0 or self.inject == "kill":
            return
        if self.rerunning and self.inject == "nan_once":
            return
        for g in grads:
            if g.numel():
                if self.inject == "spike":
                    g.mul_(1e4)
                else:
                    g.view(-1)[0] = float("nan")
                return

    def skip(self, grad_norm: Tensor) -> Tensor | None:
        """The step's skip flag (a bool tensor on the device; no host wait); None for fp16, whose
        loss scaler decides on the host."""
        if self.fp16:
            return None
        bad = ~torch.isfinite(grad_norm)  # (nan where any rank holds a non-finite gradient: training/step.py)
        if self.policy == "stop":
            self.stopped |= bad
            bad = self.stopped.clone()
        if self.spikes is not None and not self.rerunning:
            bad = bad | self.spikes.is_spike(grad_norm)
            self.spikes.record(grad_norm, ~bad)
        return bad

    def state_dict(self) -> dict:
        """What a checkpoint keeps (a resumed run skips the steps the whole run would have)."""
        return {"in_a_row": self.in_a_row, "spikes": self.spikes.state_dict() if self.spikes is not None else None}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.in_a_row = state["in_a_row"]
        if self.spikes is not None and state.get("spikes"):
            self.spikes.load_state_dict(state["spikes"])

    def check(self, launched: LaunchedStep, result, rerun: Callable[[LaunchedStep], object],
              say: Callable[[str], None]) -> None:
        """After reading step ``launched.step``'s ``result``: nothing if it was applied; else
        count it (skip), or re-run it with ``rerun`` and stop (stop). Raises NonFiniteStop."""
        if self.fp16 or not result.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        first, end = launched.samples
        loss = f"loss {result.loss:g}; " if self.knows_loss else ""
        spike = math.isfinite(result.grad_norm)
        found = (f"step {launched.step + 1}: gradient norm {result.grad_norm:g}"
                 f"{f', a spike (over {self.sigma:g} standard deviations above the last steps, train.skip_spikes)' if spike else ''}"
                 f" ({loss}the batch: samples {first}..{end - 1} of the training stream); the step changed nothing")
        if spike or self.policy == "skip":
            if self.in_a_row < self.max_in_a_row:
                say(f"tessera: {found} ({'train.skip_spikes' if spike else 'train.nonfinite=skip'}: passed over, "
                    f"{self.in_a_row} in a row)")
                return
            raise NonFiniteStop(f"{found}; {self.in_a_row} skipped steps in a row "
                                f"(train.max_skipped_steps={self.max_in_a_row}): stopped. Check the data, or "
                                f"{OTHER_SETTINGS}")
        again = rerun(launched)
        if not math.isfinite(again.grad_norm):
            verdict = (f"re-run on the same weights and random streams: gradient norm {again.grad_norm:g} again, "
                       "so it is reproducible: the batch, the model or the settings cause it, not the machine. "
                       "Look at those samples; pass such steps over with train.nonfinite=skip (the same "
                       f"command then resumes from the last checkpoint), or {OTHER_SETTINGS}")
        else:
            loss = f" (loss {again.loss:g})" if self.knows_loss else ""
            verdict = (f"re-run on the same weights and random streams: gradient norm {again.grad_norm:g}{loss}, "
                       "so it is not reproducible: a transient fault, suspect the machine (a GPU's memory, a "
                       "link). Run again (on other GPUs if it comes back)")
        kept = ("; the checkpoints saved before it are kept (finite weights), and the same command resumes "
                "from the last one" if self.checkpoints else "")
        raise NonFiniteStop(f"{found}; {verdict}. Stopped (train.nonfinite=stop){kept}")


__all__ = ["NumericsGuard", "SpikeWindow", "LaunchedStep", "NonFiniteStop"]
