"""A GPU's energy counter, read through NVML (``pip install nvidia-ml-py``; optional).

NVML keeps each GPU's total energy since the driver loaded, in millijoules (Volta and later:
``nvmlDeviceGetTotalEnergyConsumption``). Reading it is a host call that does not touch the CUDA
stream, so the trainer reads it at each log interval (training/monitor.py) and reports the job's
joules per step and per token, summed over every rank's GPU. Without a GPU, without the package,
or on a GPU without the counter there is no meter and no energy figure, silently.
"""

from __future__ import annotations

import torch


class EnergyMeter:
    """One CUDA device's energy counter; :meth:`for_device` gives None where there is none."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle

    @classmethod
    def for_device(cls, device: torch.device) -> EnergyMeter | None:
        if device.type != "cuda":
            return None
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            # the device by UUID: NVML numbers GPUs its own way, not as CUDA_VISIBLE_DEVICES does
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            meter = cls(pynvml, handle)
            meter.joules()  # (raises where the GPU has no counter)
            return meter
        except Exception:  # noqa: BLE001 -- pynvml.NVMLError and a driver without NVML alike: no meter
            return None

    def joules(self) -> float:
        """The GPU's energy since the driver loaded."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3


__all__ = ["EnergyMeter"]
