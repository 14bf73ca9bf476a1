"""Dynamic loss scaling for fp16: multiply the loss by ``scale`` before backward, divide the
gradients after; on inf/nan anywhere in the model skip the step and halve the scale, and double
it after ``growth_interval`` clean steps."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000,
                 backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0):
        checks = [(math.isfinite(init_scale) and init_scale > 0, f"init_scale {init_scale} must be a finite number > 0"),
                  (isinstance(growth_interval, int) and growth_interval >= 1,
                   f"growth_interval {growth_interval!r} must be a whole number of steps >= 1"),
                  (0 < backoff < 1, f"backoff {backoff} must be in (0, 1): it lowers the scale"),
                  (math.isfinite(growth) and growth > 1, f"growth {growth} must be a finite number > 1: it raises the scale"),
                  (0 < min_scale <= init_scale, f"min_scale {min_scale} must be in (0, init_scale = {init_scale}]")]
        for ok, problem in checks:
            if not ok:
                raise ValueError(f"DynamicLossScaler: {problem}")
        self.scale, self.growth_interval = init_scale, growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self.clean_steps = 0

    def unscale_and_check(self, grads: list[torch.Tensor], group: dist.ProcessGroup | None,
                          device: torch.device) -> bool:
        """Divide gradients by the scale; return True when every rank's gradients are finite."""
        found_inf = torch.zeros((), device=device)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            found_inf = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float().to(device)
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf.item() == 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
