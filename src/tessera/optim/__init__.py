"""Optimizer pieces: AdamW with decay groups, global-norm clipping, LR and batch schedules, loss scaling."""

from __future__ import annotations

import torch
from torch import nn

from tessera.config import OptimConfig
from tessera.optim.clip import clip_grad_norm, global_grad_norm
from tessera.optim.loss_scale import DynamicLossScaler
from tessera.optim.microbatches import MicroBatchCalculator
from tessera.optim.scheduler import LRScheduler, learning_rate


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, biases) do not. Fused on CUDA, foreach elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=on_cuda or None, foreach=None if on_cuda else True)


__all__ = ["DynamicLossScaler", "LRScheduler", "MicroBatchCalculator", "build_optimizer", "clip_grad_norm",
           "global_grad_norm", "learning_rate"]
