"""How many micro-batches make one optimizer step (Megatron's num-micro-batches calculators).

The global batch is constant, or ramps up from ``start`` by ``increment`` until ``global_batch``:
the ramp is cut into ``(global_batch - start) / increment`` equal slices of ``ramp_samples``
consumed samples, and the batch grows by one increment at the end of each slice,

    global_batch(consumed) = start + increment * floor(consumed / (ramp_samples / n_increments))

until ``consumed > ramp_samples`` (Megatron's rule), then ``global_batch``. Every batch on the way
must split into micro-batches over the data-parallel ranks, so start and increment must be
multiples of micro_batch * dp.
"""

from __future__ import annotations

from typing import Any

from tessera.config import ConfigError, TrainConfig


class MicroBatchCalculator:
    def __init__(self, global_batch: int, micro_batch: int, dp: int,
                 rampup: tuple[int, int, int] | None = None):
        self.target, self.micro_batch, self.dp = global_batch, micro_batch, dp
        self.start, self.increment, self.ramp_samples = rampup or (global_batch, 1, 0)
        self.consumed_samples = 0
        for key, value in (("train.global_batch", global_batch), ("train.micro_batch", micro_batch),
                           ("parallel.dp", dp)):
            if not value >= 1:
                raise ConfigError(key, f"{value!r} is not >= 1", "give a positive number of samples"
                                  if key != "parallel.dp" else "give the number of data-parallel ranks (>= 1)")
        per_step = micro_batch * dp
        if self.target % per_step:
            raise ConfigError("train.global_batch",
                              f"{self.target} is not divisible by micro_batch*dp = {micro_batch}*{dp}",
                              f"choose a multiple of {per_step}")
        if rampup is None:
            return
        key, fix = "train.batch_rampup", '"start,increment,ramp_samples", e.g. "4,4,1000"'
        if not (1 <= self.start <= self.target and self.increment >= 1 and self.ramp_samples >= 0):
            raise ConfigError(key, f"{rampup} needs 1 <= start <= global_batch={self.target}, "
                              "increment >= 1 and ramp_samples >= 0", f"give {fix}")
        if self.ramp_samples == 0 and self.start < self.target:
            raise ConfigError(key, f"{rampup} ramps from {self.start} to global_batch={self.target} over 0 samples",
                              "give the samples the ramp lasts (>= 1)")
        if (self.target - self.start) % self.increment:
            raise ConfigError(key, f"increment {self.increment} does not divide global_batch - start "
                              f"= {self.target - self.start}", "choose an increment that divides the difference")
        for name, value in (("start", self.start), ("increment", self.increment)):
            if value % per_step:
                raise ConfigError(key, f"{name} {value} is not divisible by micro_batch*dp = {micro_batch}*{dp}",
                                  f"choose a {name} that is a multiple of {per_step}")

    @classmethod
    def from_config(cls, train: TrainConfig, dp: int) -> MicroBatchCalculator:
        return cls(train.global_batch, train.micro_batch, dp, train.rampup)

    def global_batch(self, consumed_samples: int) -> int:
        increments = (self.target - self.start) // self.increment
        if increments == 0 or consumed_samples > self.ramp_samples:
            return self.target
        # floor(consumed / (ramp_samples / increments)) in integers: the float quotient falls
        # short of a whole slice at its boundary (9 / (18 / 14) = 6.999...)
        return self.start + self.increment * (consumed_samples * increments // self.ramp_samples)

    def num_micro_batches(self, consumed_samples: int) -> int:
        return self.global_batch(consumed_samples) // (self.micro_batch * self.dp)

    def advance(self) -> int:
        """Count one optimizer step's samples as consumed; returns that step's global batch."""
        batch = self.global_batch(self.consumed_samples)
        self.consumed_samples += batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        # micro_batch and dp are left out: a run may resume on another layout with the same batches.
        return {"consumed_samples": self.consumed_samples,
                "batches": [self.start, self.increment, self.ramp_samples, self.target]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()["batches"]
        if list(state["batches"]) != mine:
            raise ConfigError("train.batch_rampup",
                              f"the checkpoint's batches (start, increment, ramp_samples, global_batch) "
                              f"were {list(state['batches'])}, this run's are {mine}",
                              "use the checkpoint's train.global_batch and train.batch_rampup to resume")
        self.consumed_samples = state["consumed_samples"]
