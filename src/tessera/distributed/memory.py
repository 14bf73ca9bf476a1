"""What the model state costs per rank: parameters, gradients, fp32 main parameters, Adam state.

:func:`memory_report` measures the tensors a run actually holds; :func:`bytes_per_parameter` is
the textbook figure for a layout (padding aside), so users can see what each ``parallel.zero``
saves before they launch. With bf16 parameters and fp32 gradients (Megatron's table):

    zero=0   2 + 4 + 4 + 8             = 18 bytes per parameter
    zero=1   2 + 4 + (4 + 8) / dp      =  6 + 12/dp   (distributed optimizer)
    zero=2   2 + (4 + 4 + 8) / dp      =  2 + 16/dp   (gradients sharded too)
    zero=3   (4 + 4 + 8) / dp          = 16/dp        (FSDP: fp32 parameter shards are the main copy)

(params, grads, main params, Adam's two moments.) Activations and temporary buffers (a bucket in
flight, FSDP's gathered layer) come on top, and so do frozen parameters: the report counts
trainable ones.
"""

from __future__ import annotations

from dataclasses import dataclass

SIZES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class MemoryReport:
    params: int
    grads: int
    main_params: int
    optimizer_state: int
    numel: int  # parameters of this rank's model (unsharded count)
    host: int = 0  # in host memory, not in ``total``: offloaded main params, Adam state, gradient staging

    @property
    def total(self) -> int:
        """Bytes on the device."""
        return self.params + self.grads + self.main_params + self.optimizer_state

    def __str__(self) -> str:
        unit, size = ("GiB", 2**30) if self.total >= 2**30 else ("MiB", 2**20)
        return (f"model state per rank {self.total / size:.3f} {unit} ({self.total / max(self.numel, 1):.2f} bytes "
                f"per parameter): params {self.params / size:.3f}, grads {self.grads / size:.3f}, "
                f"main params {self.main_params / size:.3f}, optimizer {self.optimizer_state / size:.3f}"
                + (f"; in host memory {self.host / size:.3f} (offloaded optimizer)" if self.host else ""))


def bytes_per_parameter(zero: int, dp: int, dtype: str = "bf16", grad_dtype: str = "fp32") -> float:
    """Model-state bytes per parameter on one rank (padding aside)."""
    for name, value in (("dtype", dtype), ("grad_dtype", grad_dtype)):
        if value not in SIZES:
            raise ValueError(f"{name} must be one of {', '.join(SIZES)}, not {value!r}")
    if not (isinstance(dp, int) and dp >= 1):
        raise ValueError(f"dp is a number of data-parallel ranks >= 1, not {dp!r}")
    if type(zero) is not int or zero not in (0, 1, 2, 3):  # (True and 1.0 equal 1: refused too)
        raise ValueError(f"zero must be one of the integers 0, 1, 2, 3, not {zero!r}")
    p, g = SIZES[dtype], SIZES[grad_dtype]
    main = 0 if dtype == "fp32" else 4
    adam = 8
    fp32_grad = 0 if grad_dtype == "fp32" else 4  # the optimizer's fp32 copy of 16-bit gradients
    if zero == 0:
        return p + g + fp32_grad + main + adam
    if zero == 1:
        return p + g + (main + adam + fp32_grad) / dp
    if zero == 2:
        return p + (4 + main + adam) / dp
    return (4 + 4 + adam) / dp  # zero == 3


def memory_report(data_parallel, optimizer) -> MemoryReport:
    """Measure this rank's model state (a DataParallel and its MainParamOptimizer, or a
    FullyShardedDataParallel and its FSDPOptimizer)."""
    params, grads, numel = data_parallel.model_state_bytes()
    main, state = optimizer.main_param_bytes(), optimizer.state_bytes()
    if getattr(optimizer, "offload", False):  # (parallel.optimizer_offload: all of it in host memory)
        host = main + state + sum(g.numel() * g.element_size() for g in optimizer.staging)
        return MemoryReport(params=params, grads=grads, main_params=0, optimizer_state=0, numel=numel, host=host)
    return MemoryReport(params=params, grads=grads, main_params=main, optimizer_state=state, numel=numel)
