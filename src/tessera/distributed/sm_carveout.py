"""GEMMs that leave SMs free while data-parallel collectives run beside them.

Hopper's cuBLAS GEMMs are often persistent kernels: one CUDA block per SM, each working through
many output tiles. When an NCCL kernel holds some SMs (the overlapped gradient reduce-scatter of
the last micro-batch's backward, zero 1/2's parameter all-gather in the first forward), the
blocks that find no free SM wait until others finish all their tiles, and the GEMM can take up
to twice as long ("wave quantization"; torch PR 147966). Telling the GEMMs to use only ``sms``
fewer SMs (cuBLASLt's SM-count target, torch's ``_set_sm_carveout_experimental``) trades that for
a proportional slowdown while the window is open. The window is the host's: from the first
asynchronous collective launched until the last one is waited for; the GEMMs launched in it get
the carveout.

torch's carveout is process-wide state read at each GEMM's launch; :class:`SMCarveout` is the one
object that sets and clears it, owned by the DataParallel that opens and closes the window.
Before torch 2.12 it reaches cuBLASLt only (torch PR 183330 added plain cuBLAS), so ``for_device``
makes cuBLASLt the preferred BLAS library.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SMCarveout:
    """Opens and closes the window in which GEMMs leave ``sms`` SMs free (0: never)."""

    def __init__(self, sms: int, setter: Callable[[int | None], None], restore: Callable[[], None] | None = None):
        if sms < 0:
            raise ValueError(f"an SM carveout is a number of SMs >= 0, not {sms}")
        self.sms, self._set, self._restore, self.open = sms, setter, restore, False

    @classmethod
    def for_device(cls, sms: int, device: torch.device) -> SMCarveout:
        """The carveout for GEMMs on ``device``: torch's on CUDA (cuBLASLt preferred, since the
        carveout reaches only it), none on other devices (no GEMM there takes it)."""
        if sms == 0 or device.type != "cuda":
            return cls(0, lambda n: None)
        count = torch.cuda.get_device_properties(device).multi_processor_count
        if sms >= count:
            raise ValueError(f"parallel.dp_sm_carveout={sms} leaves no SM for the GEMMs: this GPU has {count}")
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            raise RuntimeError(f"parallel.dp_sm_carveout needs torch >= 2.7 (its SM carveout for GEMMs); this is "
                               f"torch {torch.__version__}: set parallel.dp_sm_carveout=0")
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        return cls(sms, setter, restore=lambda: torch.backends.cuda.preferred_blas_library(before))

    def start(self) -> None:
        if self.sms and not self.open:
            self._set(self.sms)
            self.open = True

    def stop(self) -> None:
        if self.open:
            self._set(None)
            self.open = False

    def close(self) -> None:
        """Closed for good (the end of training, or an error in it): the carveout cleared and
        the BLAS library preferred before put back."""
        self.stop()
        if self._restore is not None:
            self._restore()
            self._restore = None
