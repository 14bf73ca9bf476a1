"""Optimizer pieces: AdamW with decay groups, global-norm clipping, LR and batch schedules, loss scaling."""

from __future__ import annotations

from tessera.optim.clip import clip_coefficient, global_grad_norm
from tessera.optim.loss_scale import DynamicLossScaler
from tessera.optim.microbatches import MicroBatchCalculator
from tessera.optim.scheduler import LRScheduler, learning_rate


__all__ = ["DynamicLossScaler", "LRScheduler", "MicroBatchCalculator", "clip_coefficient",
           "global_grad_norm", "learning_rate"]
