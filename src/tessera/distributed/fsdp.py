"""zero=3: parameters, gradients and optimizer state sharded over dp with torch's FSDP2.

``fully_shard`` is applied to every transformer layer, then to each model chunk (its root:
embedding, final norm, head), on the ``dp`` axis of the topology's mesh. TP stays tessera's own:
the parameters FSDP shards are already each TP rank's slices, and the TP collectives run inside
the layers as without FSDP. Each layer's parameters are all-gathered for its forward and backward and
its gradients reduce-scattered (in fp32, summed: the loss is already divided by the global token
count, so FSDP's default average over dp is turned off) as soon as its backward ends, per
micro-batch; FSDP accumulates the sharded gradients. Parameters stay fp32 shards (they are the main parameters);
``MixedPrecisionPolicy`` casts them to the compute dtype when gathering. A 16-bit run first
rounds the initial weights to that dtype, as zero 0-2 do (their fp32 main parameters are made
from the model's 16-bit copy, as Megatron's): otherwise the two would train from different
master weights, the same first step and apart from the second.

FSDP2 replaces each parameter by a DTensor; the marks tessera's reductions and norms read
(``tensor_parallel``, ``sequence_parallel``, ``tied_across_stages``, ``shared_embedding``) are
copied onto the new parameters.

``fp8_gather`` (``train.fp8=tensorwise``, eager layers): the transformer layers' linear weights are
all-gathered as e4m3 bytes under their whole weight's scale, and the fp8 linear computes with
them as gathered (distributed/fsdp_fp8.py); :meth:`start_step` computes the step's scales.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tessera.distributed.fsdp_fp8 import Float8GatherScales, gather_in_fp8
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.topology import Topology

MARKS = ("tensor_parallel", "sequence_parallel", "tied_across_stages", "shared_embedding")


class FullyShardedDataParallel:
    sharded = True

    def __init__(self, chunks: list[nn.Module], topo: Topology, *, compute_dtype: torch.dtype = torch.float32,
                 fp8_gather: bool = False):
        if topo.dp_mesh is None:
            raise RuntimeError("zero=3 (FSDP) needs torch.distributed initialised (the dp mesh)")
        mesh = topo.dp_mesh  # dp x cp: the weights are replicated over cp
        policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                      reduce_dtype=torch.float32)
        gathered_in_fp8 = []  # the fp8 linears whose weights FSDP gathers in fp8
        for chunk in chunks:
            if compute_dtype != torch.float32:
                with torch.no_grad():
                    for p in chunk.parameters():
                        p.copy_(p.to(compute_dtype))
            marks = {name: {m: getattr(p, m) for m in MARKS if hasattr(p, m)}
                     for name, p in chunk.named_parameters()}
            if fp8_gather:
                gathered_in_fp8 += _wrap_fp8_weights(chunk)
            sharded = [fully_shard(layer, mesh=mesh, mp_policy=policy)
                       for layer in (chunk.layers.values() if hasattr(chunk, "layers") else [])]
            sharded.append(fully_shard(chunk, mesh=mesh, mp_policy=policy))
            for module in sharded:  # the loss is already a mean over the global batch: sum, not average
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
            for name, p in chunk.named_parameters():
                for mark, value in marks[name].items():
                    setattr(p, mark, value)
        self.chunks = chunks
        self.fp8_scales = Float8GatherScales([m.weight for m in gathered_in_fp8], mesh.get_group(),
                                             topo.group("tp"), compute_dtype) if fp8_gather else None

    def model_state_bytes(self) -> tuple[int, int, int]:
        """(parameter bytes, gradient bytes, parameter count) of the trainable parameters, as
        DataParallel counts them: fp32 shards, and the fp32 sharded gradients they get after
        backward."""
        trainable = [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]
        shards = [p.to_local() for p in trainable]
        params = sum(t.numel() * t.element_size() for t in shards)
        return params, sum(t.numel() * 4 for t in shards), sum(p.numel() for p in trainable)

    def start_step(self, num_microbatches: int) -> None:
        """The fp8 gathers' scales for the step (FSDP reduces each micro-batch's gradients in its
        backward: nothing else to prepare)."""
        if self.fp8_scales is not None:
            self.fp8_scales.refresh()

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP's post-backward waits for its reduce-scatters."""

    def wait_param_gather(self) -> None:
        """Nothing pending: FSDP gathers parameters inside each forward."""


def _wrap_fp8_weights(chunk: nn.Module) -> list[nn.Module]:
    """The tensorwise fp8 linears of ``chunk``, each weight made one FSDP gathers in fp8."""
    modules = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               and m.fp8 is not None and m.fp8.scaling == "tensorwise"]
    for m in modules:
        gather_in_fp8(m, m.tp_group)
    return modules
