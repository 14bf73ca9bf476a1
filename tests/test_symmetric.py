"""Copy-engine parameter gathers (distributed/symmetric.py): each reason they cannot run is named,
the zero-CTA options carry the policy and the group's timeout, and the topology refuses to build
the group where NCCL cannot give it. (That the gathers run on that group into the allocator's
buffers with unchanged results: tests/test_data_parallel.py; on NCCL: tests/test_gpu.py.)"""

import datetime
import types

import pytest
import torch
import torch.distributed as dist

from tessera.distributed import symmetric
from tessera.testing import run_ranks
from tessera.topology import Topology


class _Config:
    def __init__(self, with_policy: bool):
        if with_policy:
            self.cta_policy = 0


def _fake_nccl(monkeypatch, version=(2, 28, 9), with_policy=True):
    class Options:
        def __init__(self):
            self.config, self._timeout = _Config(with_policy), None

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "nccl", types.SimpleNamespace(version=lambda: version), raising=False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)


def test_each_reason_it_cannot_run_is_named(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert symmetric.unsupported(torch.device("cpu")) == "they need CUDA GPUs and NCCL, this run is on cpu"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert symmetric.unsupported(cuda) == "this torch has no NCCL"
    _fake_nccl(monkeypatch, version=(2, 27, 7))
    assert "NCCL >= 2.28 (copy-engine collectives), this torch has (2, 27, 7)" in symmetric.unsupported(cuda)
    _fake_nccl(monkeypatch, with_policy=False)
    assert "cta_policy" in symmetric.unsupported(cuda)
    assert symmetric.unsupported(cuda, copy_engine=False) is None  # symmetric kernels need no CTA policy
    _fake_nccl(monkeypatch)
    assert symmetric.unsupported(cuda) is None  # this torch has the symmetric-memory pool


def test_a_group_spanning_nodes_is_seen():
    assert not symmetric.spans_nodes([0, 1], 8) and not symmetric.spans_nodes([4, 6], 8)
    assert symmetric.spans_nodes([7, 8], 8) and symmetric.spans_nodes([0, 8, 16], 8)
    assert not symmetric.spans_nodes([3], 1)


def test_zero_cta_options_carry_the_policy_and_the_timeout(monkeypatch):
    _fake_nccl(monkeypatch)
    options = symmetric.zero_cta_options(datetime.timedelta(seconds=7))
    assert options.config.cta_policy == 2 and options._timeout == datetime.timedelta(seconds=7)
    assert symmetric.zero_cta_options().config.cta_policy == 2
    assert symmetric.zero_cta_options() is not symmetric.zero_cta_options()  # one per group


def test_allocator_refuses_where_it_cannot_run_and_without_a_group(monkeypatch):
    with pytest.raises(RuntimeError, match="NCCL symmetric memory: they need CUDA GPUs and NCCL"):
        symmetric.SymmetricAllocator(object(), torch.device("cpu"))
    monkeypatch.setattr(symmetric, "unsupported", lambda device, copy_engine=True: None)
    with pytest.raises(ValueError, match="needs a process group of several ranks"):
        symmetric.SymmetricAllocator(None, torch.device("cuda", 0))


def _build_worker(rank: int, world: int) -> str:
    try:
        Topology.build(dp=2, copy_engine_gather=True)
    except RuntimeError as e:
        return str(e)
    return "built"


def test_topology_refuses_the_gather_group_on_gloo():
    assert run_ranks(_build_worker, 2, timeout=60) == ["copy_engine_gather: they need CUDA GPUs and NCCL, "
                                                       "this run is on cpu"] * 2
    one = Topology.build(copy_engine_gather=True)  # one process: no dp group to gather over
    assert one.group("dp_gather") is None
