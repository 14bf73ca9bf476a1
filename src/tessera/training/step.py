"""One optimizer step over a global batch.

Communication plan of a step:

1. one all-reduce of the number of loss tokens over dp (so every micro-batch's loss is divided
   by the *global* count: the mean over all tokens of the global batch, however they are
   spread over micro-batches and ranks);
2. the pipeline executor runs this rank's schedule: forward/backward per micro-batch and chunk,
   activations and gradients between stages, gradients accumulating in ``param.grad`` (TP
   collectives happen inside the layers);
3. finalize: gradients summed over dp, sequence-parallel partial gradients summed over tp,
   tied-embedding copies summed over the embedding group;
4. the global gradient norm (one all-reduce over tp x pp), clipping, the AdamW step;
5. the reported loss: one all-reduce over dp (meaningful on the last pipeline stage).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tessera.distributed.finalize import finalize_model_grads
from tessera.optim import DynamicLossScaler, clip_grad_norm
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.topology import Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    skipped: bool = False


def autocast(device: torch.device, dtype: str):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict],
               topo: Topology, executor: PipelineExecutor, *, clip_grad: float, dtype: str = "fp32",
               scaler: DynamicLossScaler | None = None) -> StepResult:
    """``model`` holds this rank's chunks (the executor's), ``micro_batches`` this dp rank's share."""
    device = topo.device
    local_tokens = sum(mb["loss_mask"].sum() for mb in micro_batches).to(device, torch.float32)
    global_tokens = _sum_over(local_tokens.clone(), topo.group("dp"))
    loss_sum = executor.run(micro_batches, global_tokens, functools.partial(autocast, device, dtype),
                            loss_scale=scaler.scale if scaler is not None else 1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    finalize_model_grads(model, topo)
    finite = True
    if scaler is not None:
        finite = scaler.unscale_and_check(params, None, device)
        scaler.update(finite)
    grad_norm = clip_grad_norm(params, clip_grad, topo) if finite else torch.tensor(float("nan"))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = _sum_over(loss_sum, topo.group("dp"))
    return StepResult(loss=loss.item(), grad_norm=float(grad_norm), tokens=int(global_tokens.item()),
                      skipped=not finite)
