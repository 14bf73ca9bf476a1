"""Global batches cut into this data-parallel rank's micro-batches.

Consumption is counted in samples. A :class:`~tessera.optim.MicroBatchCalculator` (``batches=``)
says each step's global batch ``B``, so it may ramp up; ``global_batch=`` is a constant batch
(a constant calculator built internally). A step that starts with ``c`` samples consumed takes
global samples ``[c, c + B)``; data-parallel rank ``r`` takes the ``r``-th contiguous share and cuts
it into micro-batches. The union over ranks is the same whatever dp is, which is what makes loss
curves layout-independent. With a constant batch, step ``t`` is ``[t * B, (t + 1) * B)``.

The loader's position is its calculator's ``consumed_samples``: every step calls ``advance()``
once, and a calculator restored from a state dict resumes the data exactly. If the trainer shares
the calculator with the loader, it must not ``advance()`` it as well.

:func:`microbatch_counts` lists the micro-batch counts a run will use, to check each against the
pipeline schedule before training.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch

from tessera.config import ConfigError
from tessera.optim.microbatches import MicroBatchCalculator


class SampleSource(Protocol):
    def __getitem__(self, index: int) -> np.ndarray: ...


class MicroBatches:
    """Iterates steps; each item is the list of micro-batches ``{"tokens", "labels", "loss_mask"}``.

    Give either ``global_batch`` (constant; ``start_step`` skips that many steps) or ``batches``
    (a calculator; the position is its ``consumed_samples``, so ``start_step`` must stay 0).
    ``micro_batch`` and ``dp`` default to the calculator's and must match it when given.

    ``vocab_size``: every sample's ids are checked to lie in ``[0, vocab_size)``. An id past the
    model's vocabulary (data tokenized with a larger tokenizer) would otherwise fail only on one
    device as an index error, or, with a vocab-parallel embedding and cross entropy, not at all:
    no rank owns the id, its embedding is zero and its target logit is taken as 0.
    """

    def __init__(self, source: SampleSource, *, global_batch: int | None = None,
                 micro_batch: int | None = None, dp: int | None = None, dp_rank: int,
                 start_step: int = 0, batches: MicroBatchCalculator | None = None,
                 vocab_size: int | None = None):
        if batches is None:
            if global_batch is None or micro_batch is None or dp is None:
                raise ValueError("give global_batch, micro_batch and dp, or a batches= calculator")
            if global_batch % (micro_batch * dp):
                raise ValueError(f"global batch {global_batch} is not divisible by micro_batch*dp = {micro_batch * dp}")
            batches = MicroBatchCalculator(global_batch, micro_batch, dp)
            batches.consumed_samples = start_step * global_batch
        else:
            if global_batch is not None:
                raise ValueError("give either global_batch or batches=, not both")
            if start_step:
                raise ValueError("with batches=, the position is batches.consumed_samples; leave start_step at 0")
            for name, given, mine in (("micro_batch", micro_batch, batches.micro_batch), ("dp", dp, batches.dp)):
                if given is not None and given != mine:
                    raise ValueError(f"{name}={given} but the calculator was built with {name}={mine}")
        if not 0 <= dp_rank < batches.dp:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {batches.dp})")
        self.source, self.batches, self.dp_rank, self.vocab_size = source, batches, dp_rank, vocab_size
        self.micro_batch, self.dp = batches.micro_batch, batches.dp
        self.step = start_step  # steps taken (counted from start_step); the position is consumed_samples

    @property
    def consumed_samples(self) -> int:
        return self.batches.consumed_samples

    @property
    def global_batch(self) -> int:
        """The next step's global batch."""
        return self.batches.global_batch(self.batches.consumed_samples)

    @property
    def num_micro_batches(self) -> int:
        """The next step's micro-batches on this rank."""
        return self.batches.num_micro_batches(self.batches.consumed_samples)

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        consumed = self.batches.consumed_samples
        batch = self.batches.advance()
        share = batch // self.dp
        first = consumed + self.dp_rank * share
        self.step += 1
        out = []
        for m in range(share // self.micro_batch):
            start = first + m * self.micro_batch
            rows = np.stack([self.source[start + j] for j in range(self.micro_batch)])
            if self.vocab_size is not None:
                self._check_ids(rows, start)
            rows = torch.from_numpy(rows.astype(np.int64))
            out.append({"tokens": rows[:, :-1], "labels": rows[:, 1:],
                        "loss_mask": torch.ones(rows.shape[0], rows.shape[1] - 1)})
        return out

    def _check_ids(self, rows: np.ndarray, start: int) -> None:
        low, high = int(rows.min()), int(rows.max())
        if low >= 0 and high < self.vocab_size:
            return
        bad = high if high >= self.vocab_size else low
        row = int(np.argwhere(rows == bad)[0][0])
        raise ConfigError("model.vocab_size", f"sample {start + row} holds token id {bad}, outside the model's "
                          f"vocabulary [0, {self.vocab_size}): the data was tokenized with another tokenizer",
                          "set model.vocab_size to the tokenizer's size (`tessera data inspect PREFIX --show N` "
                          "prints document N's ids; the sample number is the shuffled sample index), or "
                          "preprocess the data with the model's tokenizer",
                          rank_local=True)


def microbatch_counts(calculator: MicroBatchCalculator, steps: int,
                      consumed_samples: int | None = None) -> list[int]:
    """Sorted distinct per-rank micro-batch counts of the next ``steps`` steps, starting from
    ``consumed_samples`` (default: the calculator's own). The calculator is not changed."""
    calc = copy.copy(calculator)
    calc.consumed_samples = calculator.consumed_samples if consumed_samples is None else consumed_samples
    counts: set[int] = set()
    for _ in range(steps):
        if calc.consumed_samples > calc.ramp_samples:  # past the ramp: the batch stays the target
            counts.add(calc.num_micro_batches(calc.consumed_samples))
            break
        counts.add(calc.num_micro_batches(calc.consumed_samples))
        calc.advance()
    return sorted(counts)
