"""zero=3 with ``train.fp8=tensorwise``: FSDP's parameter all-gather moves the transformer layers'
linear weights as e4m3 bytes, half of bf16's, and the fp8 linear computes with them as gathered.

FSDP2's all-gather extension: a sharded parameter whose local tensor defines
``fsdp_pre_all_gather`` (what to gather from the shard) and ``fsdp_post_all_gather`` (the
unsharded parameter from what was gathered). :class:`Float8ShardWeight` wraps the fp32 shard
(the main parameter: the optimizer and checkpoints see its plain values) and gathers it cast to
the compute dtype and quantized to e4m3 under the scale of the whole logical weight: the shards'
amaxes all-reduced with MAX over the FSDP group, then over TP (tessera's weights are TP slices).
Quantizing commutes with gathering under a shared scale, so the gathered bytes equal
``quantize`` of the gathered weight, as the fp8 linear would cast it. The unsharded parameter is
a :class:`Float8Weight` (those bytes and their factor, seen as a compute-dtype tensor), which
``fp8_linear`` uses directly, with no cast of its own.

Scales (:class:`Float8GatherScales`): computed for all weights at the start of a step (one
stacked amax, two all-reduces), kept until the weights change (the optimizer's step and a
checkpoint load drop them, training/build.py); a gather without them computes its weight's own.
Both ways give the same scale, so they give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from tessera.precision.fp8 import E4M3, amax_over_group, quantize_with_amax

aten = torch.ops.aten


@dataclass(eq=False)
class GatherScale:
    """What a weight's gather needs beside its shard, shared by every tensor FSDP derives from
    the shard: the weight's TP group, and its whole amax while that holds."""

    tp_group: object
    amax: Tensor | None = None  # [1, 1] fp32, set by Float8GatherScales.refresh


def local_amax(shard: Tensor, dtype: torch.dtype) -> Tensor:
    """max |shard| [1, 1] as the compute dtype rounds it (what ``quantize`` reads from the gathered
    weight); 0 for an empty shard (a rank past the last row holds none)."""
    if shard.numel() == 0:
        return torch.zeros(1, 1, device=shard.device)
    return shard.detach().to(dtype).abs().float().amax(dim=tuple(range(shard.dim())), keepdim=True)


def _writes_first(func) -> bool:
    """Whether ``func`` writes its first argument in place (``copy_``, ``add_``, ``_foreach_mul_``)."""
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


# The ops FSDP shards, pads and views a parameter with: their results stay gatherable in fp8.
# Everything else (the optimizer's arithmetic, zeros_like for its moments, a checkpoint's copy)
# runs on the plain shard and returns plain tensors, so nothing outside FSDP sees the wrapper.
_SHARD_OPS = {aten.detach.default, aten.alias.default, aten.view.default, aten.slice.Tensor,
              aten.split.Tensor, aten.split_with_sizes.default, aten.as_strided.default,
              aten.new_zeros.default, aten.new_empty.default}


class Float8ShardWeight(torch.Tensor):
    """The local shard of a weight under FSDP (fp32, the main parameter), gathered in e4m3: the
    pre-all-gather hook casts it, the post-all-gather hook makes the :class:`Float8Weight`."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: Tensor, scale: GatherScale):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, scale: GatherScale):
        self._tensor, self._scale = tensor, scale

    def __repr__(self) -> str:
        return f"Float8ShardWeight({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], self._scale

    @staticmethod
    def __tensor_unflatten__(inner, scale, outer_size, outer_stride):
        return Float8ShardWeight(inner["_tensor"], scale)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        scale = next(a._scale for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func in _SHARD_OPS:
            return pytree.tree_map_only(Tensor, lambda t: cls(t, scale), out)
        if _writes_first(func) and isinstance(args[0], cls):
            return args[0]  # (an in-place op returns the tensor it wrote)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """(the e4m3 shard's bytes, padded to FSDP's shard rows), (its dequantizing factor,): cast
        to the compute dtype as FSDP would gather it, then quantized under the whole weight's scale."""
        s = self._scale
        shard = self._tensor.to(mp_policy.param_dtype or self._tensor.dtype)
        rows = -(-outer_size[0] // mesh.size())  # torch.chunk's rows per rank; the last ranks pad
        if shard.shape[0] < rows:
            shard = F.pad(shard, (0, 0, 0, rows - shard.shape[0]))
        amax = s.amax
        if amax is None:  # (no refresh since the weights changed: every rank alike, so collective)
            amax = amax_over_group(amax_over_group(local_amax(shard, shard.dtype), mesh.get_group()), s.tp_group)
        q, inv = quantize_with_amax(shard, E4M3, amax)
        return (q.view(torch.uint8),), (inv,)  # (c10d moves bytes, not fp8: gloo has no fp8 type)

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], metadata: tuple, param_dtype: torch.dtype, *,
                             out: Tensor | None = None):
        """The unsharded weight from the gathered bytes: a new :class:`Float8Weight`, or, from the
        second gather on, FSDP's existing one (its bytes already rewritten in place) given the new
        factor."""
        (data,), (inv,) = outputs, metadata
        if out is not None:
            out._inv = inv
            return None
        return Float8Weight(data.view(E4M3), inv, param_dtype), (data,)


_WEIGHT_OPS = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default}


class Float8Weight(torch.Tensor):
    """A weight gathered in e4m3 with its dequantizing factor, seen as a ``dtype`` tensor of the
    weight's shape. The fp8 linear takes :meth:`fp8` as its cast weight; any other read sees the
    dequantized values."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: Tensor, inv: Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            device=data.device, requires_grad=False)

    def __init__(self, data: Tensor, inv: Tensor, dtype: torch.dtype):
        self._data, self._inv = data, inv

    def __repr__(self) -> str:
        return f"Float8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, factor={self._inv.flatten()})"

    def fp8(self) -> tuple[Tensor, Tensor]:
        """(the e4m3 weight [n, k], its dequantizing factor [1, 1]): as ``quantize`` casts it."""
        return self._data, self._inv

    def dequantize(self) -> Tensor:
        return (self._data.float() * self._inv).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _WEIGHT_OPS:
            w = args[0]
            return cls(func(w._data, *args[1:], **(kwargs or {})), w._inv, w.dtype)
        if _writes_first(func) and isinstance(args[0], cls):
            raise RuntimeError(f"{func} writes a weight FSDP gathered in fp8: write its sharded parameter")
        return func(*pytree.tree_map_only(cls, lambda t: t.dequantize(), args),
                    **pytree.tree_map_only(cls, lambda t: t.dequantize(), kwargs or {}))


def gather_in_fp8(module: nn.Module, tp_group) -> None:
    """Make ``module.weight`` (a slice over ``tp_group``) one FSDP gathers in fp8, before
    ``fully_shard``. Its state dict holds the plain shard, and loading one drops its scale."""
    scale = GatherScale(tp_group)
    weight = module.weight
    module.weight = nn.Parameter(Float8ShardWeight(weight.detach(), scale), requires_grad=weight.requires_grad)
    module.register_state_dict_post_hook(_plain_state)
    module.register_load_state_dict_post_hook(lambda *_: setattr(scale, "amax", None))


def _plain_state(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """``state_dict``'s weight as the plain shard (a DTensor of it under FSDP): no wrapper leaves."""
    key = prefix + "weight"
    value = state.get(key)
    if isinstance(value, DTensor):
        state[key] = DTensor.from_local(plain_shard(value.to_local()), value.device_mesh, value.placements,
                                        run_check=False, shape=value.shape, stride=value.stride())
    elif value is not None:
        state[key] = plain_shard(value)


def plain_shard(local: Tensor) -> Tensor:
    """A sharded parameter's local tensor as a plain tensor (the same storage): what checkpoints
    read and write."""
    return local._tensor if isinstance(local, Float8ShardWeight) else local


class Float8GatherScales:
    """The global amaxes of the weights gathered in fp8, for all of them at once: :meth:`refresh`
    at a step's start (every rank alike), :meth:`invalidate` when the weights change."""

    def __init__(self, params: list, fsdp_group, tp_group, dtype: torch.dtype):
        self.params, self.fsdp_group, self.tp_group, self.dtype = params, fsdp_group, tp_group, dtype

    def _shards(self) -> list[Float8ShardWeight]:
        with torch.no_grad():
            return [p.to_local() for p in self.params]

    @torch.no_grad()
    def refresh(self) -> None:
        """Each weight's amax over its whole logical tensor: the shards' stacked, one all-reduce
        with MAX over the FSDP group and one over TP."""
        if not self.params:
            return
        shards = self._shards()
        amax = torch.stack([local_amax(plain_shard(s), self.dtype) for s in shards])
        amax = amax_over_group(amax_over_group(amax, self.fsdp_group), self.tp_group)
        for shard, a in zip(shards, amax.unbind()):
            shard._scale.amax = a

    def invalidate(self, *_) -> None:
        """Drop the amaxes (arguments ignored: an optimizer hook passes some); until the next
        refresh, each gather computes its own."""
        for shard in self._shards():
            shard._scale.amax = None
