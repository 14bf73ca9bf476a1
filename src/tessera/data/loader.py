"""Global batches cut into this data-parallel rank's micro-batches.

Step ``t`` consumes global samples ``[t * global_batch, (t + 1) * global_batch)``; data-parallel
rank ``r`` takes the ``r``-th contiguous share and cuts it into micro-batches. The union over
ranks is the same whatever dp is, which is what makes loss curves layout-independent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch


class SampleSource(Protocol):
    def __getitem__(self, index: int) -> np.ndarray: ...


class MicroBatches:
    """Iterates steps; each item is the list of micro-batches ``{"tokens", "labels", "loss_mask"}``."""

    def __init__(self, source: SampleSource, *, global_batch: int, micro_batch: int, dp: int,
                 dp_rank: int, start_step: int = 0):
        if global_batch % (micro_batch * dp):
            raise ValueError(f"global batch {global_batch} is not divisible by micro_batch*dp = {micro_batch * dp}")
        self.source, self.global_batch, self.micro_batch = source, global_batch, micro_batch
        self.dp, self.dp_rank, self.step = dp, dp_rank, start_step

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        share = self.global_batch // self.dp
        first = self.step * self.global_batch + self.dp_rank * share
        self.step += 1
        out = []
        for m in range(self.num_micro_batches):
            rows = np.stack([self.source[first + m * self.micro_batch + j] for j in range(self.micro_batch)])
            rows = torch.from_numpy(rows.astype(np.int64))
            out.append({"tokens": rows[:, :-1], "labels": rows[:, 1:],
                        "loss_mask": torch.ones(rows.shape[0], rows.shape[1] - 1)})
        return out
