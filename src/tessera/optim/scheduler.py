"""Learning rate: linear warmup to ``optim.lr``, then cosine decay to ``optim.min_lr``."""

from __future__ import annotations

import math

from tessera.config import OptimConfig


def learning_rate(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The rate for optimizer step ``step`` (0-based). Warmup reaches ``lr`` at its last step;
    the cosine runs over ``decay_steps`` (default: all steps) and stays at ``min_lr`` after."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    decay_end = cfg.decay_steps or total_steps
    if step >= decay_end or decay_end <= cfg.warmup:
        return cfg.min_lr
    progress = (step - cfg.warmup) / (decay_end - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
