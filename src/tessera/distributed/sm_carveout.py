"""GEMMs that leave SMs free while collectives run beside them.

Hopper's cuBLAS GEMMs are often persistent kernels: one CUDA block per SM, each working through
many output tiles. When an NCCL kernel holds some SMs (the overlapped gradient reduce-scatter of
the last micro-batch's backward, zero 1/2's parameter all-gather in the first forward, the TP
input-gradient reduction that the weight-gradient GEMM overlaps), the blocks that find no free
SM wait until others finish all their tiles, and the GEMM can take up to twice as long ("wave
quantization"; torch PR 147966). Telling the GEMMs to use fewer SMs (cuBLASLt's SM-count target,
torch's ``_set_sm_carveout_experimental``) trades that for a proportional slowdown while a window
is open.

torch's carveout is process-wide state read at each GEMM's launch (and frozen into a CUDA graph
captured under it). :class:`SMCarveout` is the one object of a run that sets and clears it: each
user opens and closes its own named window with its SM count ("dp": DataParallel, from the first
asynchronous collective of the step's last micro-batch, or of the parameter gathers, until the
last is waited for; "tp": the TP layers' overlapped weight-gradient GEMM), and while any window is
open the largest count is in force (not the sum: dp and TP collectives at once get the larger
alone). Before torch 2.12 the carveout reaches cuBLASLt only (torch PR 183330 added plain cuBLAS),
so while any window is open cuBLASLt is the preferred BLAS library; outside them nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SMCarveout:
    """torch's GEMM SM carveout, shared by the run's windows (see the module's text). ``blas``:
    like ``torch.backends.cuda.preferred_blas_library`` (no argument: the preferred library;
    one: set it), switched to cuBLASLt while a window is open."""

    def __init__(self, setter: Callable[[int | None], None], blas: Callable | None = None):
        self._set, self._blas = setter, blas
        self._windows: dict[str, int] = {}
        self._current: int | None = None
        self._blas_before = None

    @classmethod
    def none(cls) -> SMCarveout:
        """A carveout that never reaches a GEMM (CPU runs, no window asked for)."""
        return cls(lambda n: None)

    @classmethod
    def for_device(cls, device: torch.device, largest: int) -> SMCarveout:
        """The carveout for GEMMs on ``device`` whose windows ask for at most ``largest`` SMs:
        torch's on CUDA, none elsewhere or when ``largest`` is 0. Making it changes nothing in
        torch; opening a window does, closing the last one puts it back."""
        if largest < 0:
            raise ValueError(f"an SM carveout is a number of SMs >= 0, not {largest}")
        if largest == 0 or device.type != "cuda":
            return cls.none()
        count = torch.cuda.get_device_properties(device).multi_processor_count
        if largest >= count:
            raise ValueError(f"an SM carveout of {largest} leaves no SM for the GEMMs: this GPU has {count}")
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            raise RuntimeError(f"parallel.dp_sm_carveout / tp_sm_carveout need torch >= 2.7 (its SM carveout for "
                               f"GEMMs); this is torch {torch.__version__}: set them to 0")
        return cls(setter, blas=torch.backends.cuda.preferred_blas_library)

    def open(self, name: str, sms: int) -> None:
        """Window ``name`` open with ``sms`` SMs left free (0: nothing to open)."""
        if sms < 0:
            raise ValueError(f"an SM carveout is a number of SMs >= 0, not {sms}")
        if sms and self._windows.get(name) != sms:
            self._windows[name] = sms
            self._apply()

    def close(self, name: str) -> None:
        if self._windows.pop(name, None) is not None:
            self._apply()

    def is_open(self, name: str | None = None) -> bool:
        return bool(self._windows) if name is None else name in self._windows

    def release(self) -> None:
        """Every window closed (the end of training, or an error in it): torch as it was."""
        self._windows.clear()
        self._apply()

    def _apply(self) -> None:
        """The largest open count in force (none when no window is open); cuBLASLt preferred
        from the first window's opening to the last one's closing."""
        target = max(self._windows.values()) if self._windows else None
        if target == self._current:
            return
        if self._current is None and self._blas is not None:
            self._blas_before = self._blas()
            self._blas("cublaslt")
        self._set(target)
        if target is None and self._blas is not None:
            self._blas(self._blas_before)
        self._current = target


class Window:
    """``with window:`` opens ``carveout``'s window ``name`` with ``sms`` SMs for the block (the
    TP layers' overlapped weight-gradient GEMM)."""

    def __init__(self, carveout: SMCarveout, name: str, sms: int):
        self.carveout, self.name, self.sms = carveout, name, sms

    def __enter__(self) -> None:
        self.carveout.open(self.name, self.sms)

    def __exit__(self, *exc) -> None:
        self.carveout.close(self.name)
