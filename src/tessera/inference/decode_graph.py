"""A decode step as one CUDA graph: the forward of every layer for one token per sequence, the
cache written in place at the slot the cache's device tensor names, the logits gathered over TP,
captured once and replayed each step (a few microseconds of launch for hundreds of kernels).

What makes the step capturable is in models/kv_cache.py: preallocated caches, writes at a device
slot (``index_copy_``), attention over the whole capacity masked to the valid slots (a static
shape), positions computed on the device. Sampling runs eagerly after the replay. pp=1 only (the
pipeline's messages are not captured). ``tessera generate`` replays it by default on CUDA at tp=1
and pp=1, where benchmarks/decode.py measured it (645 tokens/s at batch 1 against eager's 44);
``--cuda-graph on`` also at tp>1, ``off`` never.

:func:`compile_step` compiles the same step with inductor first (``--compile on``: 1.13x at batch
1 once compiled), so that the graph replays fused kernels instead of each norm, rotation,
residual add and cache write alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def compile_step(step: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``step`` compiled whole by inductor, the cache still written in place (a scatter); the default
    mode, not reduce-overhead, since :class:`DecodeGraph` captures it (on a CPU it runs uncaptured).
    The first shapes compile static, a new batch size or capacity once more with those sizes
    symbolic (``dynamic=None``): many batches stay under dynamo's recompile limit, an error with
    fullgraph."""
    return torch.compile(step, fullgraph=True, dynamic=None)


class DecodeGraph:
    """``step(tokens)`` captured: calling it copies ``tokens`` [b] into the captured input, replays,
    and returns the captured output (overwritten by the next call). ``warmups``: runs before the
    capture (two for a compiled step: the first compiles, the second runs what the capture records)."""

    def __init__(self, step: Callable[[Tensor], Tensor], tokens: Tensor, warmups: int = 1):
        self.tokens = tokens.clone()
        # warm up on a side stream (lazy initialisations, NCCL communicators, cuBLAS workspaces,
        # compilation); each run writes the same slot the replay writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                step(self.tokens)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step(self.tokens)

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.output


__all__ = ["DecodeGraph", "compile_step"]
