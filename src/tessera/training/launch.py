"""Joining the job: read torchrun's environment, pick the device and backend, init c10d.

Without torchrun's variables this is a single process and no process group is created.
gloo on CPU, NCCL on CUDA; the collective timeout comes from ``train.timeout_s`` so a dead peer
ends the job with an error instead of a silent hang.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from tessera.config import ConfigError


def world_from_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) when not launched."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


def check_device(choice: str, cuda_graphs: bool | str = "auto", fp8: str = "none") -> None:
    """Refuse train.device=cuda where there is no CUDA device, train.cuda_graphs=true where the run
    will not be on one, and train.fp8 on a GPU without float8 matrix units (every rank alike: said
    once, by rank 0; also the launcher's early check, before torchrun)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "cuda, but this machine has no CUDA device available",
                          "set train.device=auto or cpu")
    if cuda_graphs is True and (choice == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("train.cuda_graphs", "CUDA graphs need a CUDA device, this run is on the CPU",
                          "set train.cuda_graphs=false on CPU")
    on_gpu = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if fp8 != "none" and on_gpu and torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError("train.fp8", f"{fp8}, but {torch.cuda.get_device_name()} has no float8 matrix units "
                          "(compute capability 8.9 or newer: Ada, Hopper)", "set train.fp8=none")


def pick_device(choice: str, local_rank: int) -> torch.device:
    check_device(choice)
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        # One visible GPU: this process's own (a launcher such as SLURM's may give each process
        # one through CUDA_VISIBLE_DEVICES). Several: the local rank's, never wrapped onto another
        # rank's (two ranks on one GPU, which NCCL refuses later, obscurely).
        count = torch.cuda.device_count()
        if count > 1 and local_rank >= count:
            raise RuntimeError(f"this process is local rank {local_rank} (LOCAL_RANK) but sees {count} CUDA "
                               f"devices: launch at most {count} processes per node (--nproc-per-node)")
        device = torch.device("cuda", local_rank if count > 1 else 0)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float) -> None:
    _, _, world = world_from_env()
    if world == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def restart_count() -> int:
    """How often torchrun has restarted this job's workers (``--max-restarts``): 0 in the first attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
