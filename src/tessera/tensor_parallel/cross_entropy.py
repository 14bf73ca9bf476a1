"""Cross entropy over a vocabulary split across TP ranks, without gathering the logits.

Each rank holds logits for its slice of the (padded) vocabulary. Three all-reduces of
``[seq, batch]``-sized tensors replace one all-gather of ``[seq, batch, vocab]``:

1. the max over the vocabulary (for a stable softmax),
2. the logit of the target token (only the rank that owns it contributes),
3. the sum of exponentials.

``loss = log(sum_exp) - target_logit``; the gradient is ``softmax - onehot``, computed locally.
It must be applied to the *local* shard: applied to gathered logits it would add log(tp).
Logits of padding rows (global index >= vocab_size) are set to -inf, so they get no probability.
"""

from __future__ import annotations

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

        outside = (target < start) | (target >= start + rows)
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


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group: Group, vocab_size: int) -> Tensor:
    """Per-token loss (fp32) from this rank's logit slice.

    logits: [..., padded_vocab / tp], target: [...] global token ids < vocab_size.
    The gradient w.r.t. ``logits`` is returned in fp32 and cast back by autograd.
    """
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
    return loss
