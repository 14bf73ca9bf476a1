"""Cross entropy over a vocabulary split across TP ranks, without gathering the logits.

Each rank holds logits for its slice of the (padded) vocabulary. Three all-reduces of
``[seq, batch]``-sized tensors replace one all-gather of ``[seq, batch, vocab]``:

1. the max over the vocabulary (for a stable softmax),
2. the logit of the target token (only the rank that owns it contributes),
3. the sum of exponentials.

``loss = log(sum_exp) - target_logit``; the gradient is ``softmax - onehot``, computed locally.
It must be applied to the *local* shard: applied to gathered logits it would add log(tp).
Logits of padding rows (global index >= vocab_size) are set to -inf, so they get no probability.

Two implementations with the same semantics:

* the reference (:class:`_VocabParallelCrossEntropy`): plain tensor ops on an fp32 copy of the
  logits, which it keeps (as the softmax) for backward;
* the fused one (:class:`_FusedVocabParallelCrossEntropy`, chosen on CUDA): the per-row
  statistics (max, sum of exponentials, target logit) and the gradient are each one
  ``torch.compile``-generated kernel that reads the 16-bit logits and upcasts in registers, so
  no fp32 copy of the ``[tokens, vocab]`` logits is ever stored; backward recomputes the softmax
  from the saved 16-bit logits and writes the 16-bit gradient directly. The two statistics that
  need a TP sum travel in one all-reduce.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.tensor_parallel.mappings import Group, group_rank, group_size


def _all_reduce(x: Tensor, group: Group, op=dist.ReduceOp.SUM) -> Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: Group, vocab_size: int) -> Tensor:
        rows = logits.shape[-1]
        start = group_rank(group) * rows
        logits = logits.to(torch.float32, copy=True)
        valid = vocab_size - start
        if valid < rows:
            logits[..., max(valid, 0):] = float("-inf")

        logits_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))

        outside = (target < start) | (target >= start + min(max(valid, 0), rows))
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(target_logit.masked_fill(outside, 0.0), group)

        exp = logits.exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        loss = torch.log(sum_exp) - target_logit

        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax
        ctx.save_for_backward(exp, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # reuse the buffer: the saved softmax is not needed again
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def _real_columns(logits: Tensor, valid: int) -> Tensor:
    """[rows] bool: which local columns are real vocabulary entries (the rest is padding)."""
    return torch.arange(logits.shape[-1], device=logits.device) < valid


def _row_max(logits: Tensor, valid: int) -> Tensor:
    z = logits.float().masked_fill(~_real_columns(logits, valid), float("-inf"))
    return z.amax(dim=-1)


def _row_stats(logits: Tensor, row_max: Tensor, local_target: Tensor, outside: Tensor, valid: int) -> Tensor:
    """[2, ...]: the sum of exp(logit - max) over the real columns, and the target's logit - max
    (0 where another rank owns the target)."""
    z = logits.float() - row_max.unsqueeze(-1)
    sum_exp = z.masked_fill(~_real_columns(logits, valid), float("-inf")).exp().sum(dim=-1)
    target = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return torch.stack([sum_exp, target])


def _logits_grad(logits: Tensor, row_max: Tensor, sum_exp: Tensor, local_target: Tensor, outside: Tensor,
                 grad_loss: Tensor, valid: int) -> Tensor:
    """(softmax - onehot) * grad_loss, in the logits' dtype."""
    z = (logits.float() - row_max.unsqueeze(-1)).masked_fill(~_real_columns(logits, valid), float("-inf"))
    softmax = z.exp() / sum_exp.unsqueeze(-1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (columns == local_target.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    return ((softmax - onehot.float()) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class _Kernels:
    """The fused path's three functions: compiled on CUDA (one generated kernel each, built on
    first use per shape), plain eager ops elsewhere (what the CPU tests check the maths with)."""

    def __init__(self, compiled: bool):
        # dynamic=None: a second shape recompiles once with symbolic sizes (a new micro-batch or
        # vocabulary shape never exhausts the recompile limit); no fullgraph, so a failure to
        # compile degrades to eager instead of raising
        wrap = (lambda f: torch.compile(f, dynamic=None)) if compiled else (lambda f: f)
        self.row_max, self.row_stats, self.logits_grad = wrap(_row_max), wrap(_row_stats), wrap(_logits_grad)


@functools.cache
def _kernels(compiled: bool) -> _Kernels:
    return _Kernels(compiled)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: Group, vocab_size: int) -> Tensor:
        rows = logits.shape[-1]
        start = group_rank(group) * rows
        valid = min(max(vocab_size - start, 0), rows)
        kernels = _kernels(logits.is_cuda)
        row_max = _all_reduce(kernels.row_max(logits, valid), group, dist.ReduceOp.MAX)
        outside = (target < start) | (target >= start + valid)
        local_target = (target - start).masked_fill(outside, 0)
        sum_exp, target_logit = _all_reduce(kernels.row_stats(logits, row_max, local_target, outside, valid),
                                            group)
        ctx.save_for_backward(logits, row_max, sum_exp, local_target, outside)
        ctx.valid, ctx.kernels = valid, kernels
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, row_max, sum_exp, local_target, outside = ctx.saved_tensors
        grad = ctx.kernels.logits_grad(logits, row_max, sum_exp, local_target, outside,
                                       grad_loss.contiguous(), ctx.valid)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group: Group, vocab_size: int,
                                 fused: bool | None = None) -> Tensor:
    """Per-token loss (fp32) from this rank's logit slice.

    logits: [..., padded_vocab / tp], target: [...] global token ids in ``[0, vocab_size)``. An id
    outside that range (padding included) is owned by no rank: both paths then return
    ``log(sum_exp)``, the loss with the target's logit taken as 0, and raise nothing (a check here
    would make the host wait for the GPU); the trainer checks its data's ids
    (``data/loader.py``), direct callers must.
    ``fused``: the compiled kernels (default on CUDA) or the reference ops (default elsewhere);
    ``fused=True`` on a CPU runs the fused formulation eagerly. The reference path's gradient
    w.r.t. ``logits`` is fp32 and cast back by autograd; the fused path's is in the logits' dtype.
    """
    # Shape checks only (no device sync): a mis-shaped target fails inside gather, or, with a
    # dim of size 1 (e.g. [s, 1] for [s, b] logits), is gathered and broadcast silently.
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match the logits' {tuple(logits.shape[:-1])} "
                         f"(logits {tuple(logits.shape)} = [..., padded_vocab / tp])")
    columns = logits.shape[-1] * group_size(group)
    if not 0 < vocab_size <= columns:
        raise ValueError(f"vocab_size {vocab_size} does not fit the {columns} logit columns over the TP group "
                         f"({logits.shape[-1]} per rank): pass this rank's slice of the padded vocabulary")
    if fused is None:
        fused = logits.is_cuda
    fn = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return fn.apply(logits, target, group, vocab_size)
