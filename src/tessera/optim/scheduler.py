"""Learning-rate and weight-decay schedules (Megatron's OptimizerParamScheduler).

Steps are 0-based optimizer steps. ``W`` = optim.warmup, ``D`` = optim.decay_steps or the
run's total steps (warmup included), ``p = (step - W) / (D - W)`` the progress of the decay.

    warmup (step < W)       lr * (step + 1) / W            reaches lr at step W-1
    constant                lr
    linear                  min_lr + (lr - min_lr) * (1 - p)
    cosine                  min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
    inverse-square-root     max(min_lr, lr * sqrt(max(W, 1)) / sqrt(max(step, 1)))
    wsd                     lr until D - S, then min_lr + (lr - min_lr) * (D - step) / S,
                            S = optim.wsd_decay_steps or 10% of D - W (at least 1)

linear, cosine and wsd stay at min_lr from step D on (also when D <= W); inverse-square-root
ignores D, as in Megatron. Weight decay runs over the same D steps, ``r = min(step / D, 1)``:
constant keeps optim.weight_decay; linear is start + (end - start) * r; cosine is
start + (end - start) * (1 - cos(pi * r)) / 2.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tessera.config import ConfigError, OptimConfig

# The settings a schedule depends on; a resumed run must use the same ones.
_SETTINGS = ("lr", "min_lr", "warmup", "decay_style", "decay_steps", "wsd_decay_steps", "weight_decay",
             "weight_decay_incr_style", "start_weight_decay", "end_weight_decay")


class LRScheduler:
    """The learning rate and weight decay of each step, set on the optimizer by :meth:`apply`."""

    def __init__(self, cfg: OptimConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.decay_end = cfg.decay_steps or total_steps
        span = max(self.decay_end - cfg.warmup, 0)
        self.wsd_steps = cfg.wsd_decay_steps or max(1, round(0.1 * span))
        if cfg.decay_style == "wsd" and cfg.wsd_decay_steps > span:
            if span == 0:
                raise ConfigError("optim.warmup", f"{cfg.warmup} warmup steps leave no steps to decay before the "
                                  f"decay end {self.decay_end} (optim.decay_steps, or train.steps)",
                                  f"use fewer than {self.decay_end} warmup steps")
            raise ConfigError("optim.wsd_decay_steps",
                              f"{cfg.wsd_decay_steps} exceeds the {span} steps between warmup and the decay end",
                              f"choose at most {span}, or 0 for 10% of them")

    def lr(self, step: int) -> float:
        c, end = self.cfg, self.decay_end
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        if c.decay_style == "constant":
            return c.lr
        if c.decay_style == "inverse-square-root":
            return max(c.min_lr, c.lr * math.sqrt(max(c.warmup, 1)) / math.sqrt(max(step, 1)))
        if step >= end or end <= c.warmup:
            return c.min_lr
        if c.decay_style == "wsd":
            left = end - step  # 1 .. end - warmup
            return c.lr if left > self.wsd_steps else c.min_lr + (c.lr - c.min_lr) * left / self.wsd_steps
        progress = (step - c.warmup) / (end - c.warmup)
        if c.decay_style == "linear":
            return c.min_lr + (c.lr - c.min_lr) * (1.0 - progress)
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + math.cos(math.pi * progress))

    def weight_decay(self, step: int) -> float:
        c = self.cfg
        if c.weight_decay_incr_style == "constant":
            return c.weight_decay
        ratio = min(step / self.decay_end, 1.0) if self.decay_end > 0 else 1.0
        if c.weight_decay_incr_style == "cosine":
            ratio = 0.5 * (1.0 - math.cos(math.pi * ratio))
        return c.start_weight_decay + (c.end_weight_decay - c.start_weight_decay) * ratio

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every group's lr, and the weight decay of the decaying groups; returns the lr.
        A group decays where it says so (``"decays"``, set where the groups are made:
        optim/optimizers.py); a group without the tag decays if its weight_decay is non-zero the
        first time it is seen here (the tag is then kept in the group, so a schedule that passes
        through 0 does not lose it)."""
        lr, wd = self.lr(step), self.weight_decay(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
            if group.setdefault("decays", group["weight_decay"] != 0):
                group["weight_decay"] = wd
        return lr

    def state_dict(self) -> dict[str, Any]:
        settings = {name: getattr(self.cfg, name) for name in _SETTINGS}
        return {"settings": settings | {"decay_end": self.decay_end}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a state built with other settings: a resumed run would silently change schedule.
        The run's length counts only through the decay's end D: with optim.decay_steps set, a
        resumed run may train longer (it stays at min_lr after D)."""
        mine = self.state_dict()["settings"]
        for name, saved in state["settings"].items():
            if name == "decay_steps":  # (what counts is the step it resolves to: decay_end)
                continue
            if mine.get(name) != saved:
                if name == "decay_end":
                    raise ConfigError("train.steps", f"the checkpoint's schedule decays until step {saved}, "
                                      f"this run's until step {mine[name]}",
                                      f"set optim.decay_steps={saved} (or train.steps back) to resume")
                raise ConfigError(f"optim.{name}", f"the checkpoint's schedule used {saved!r}, this run {mine.get(name)!r}",
                                  f"set it back to {saved!r} to resume")


def learning_rate(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The rate for optimizer step ``step`` (0-based); see :class:`LRScheduler`."""
    return LRScheduler(cfg, total_steps).lr(step)
