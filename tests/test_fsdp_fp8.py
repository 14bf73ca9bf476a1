"""zero=3 with ``train.fp8=tensorwise`` gathers the fp8 linears' weights in fp8
(distributed/fsdp_fp8.py): FSDP moves e4m3 bytes, the gathered weight is the fp8 cast of the
whole weight bit for bit (tp=2 x dp=2, uneven and empty shards, fp32 and bf16, scales precomputed
or not), training is bit-identical to gathering train.dtype, and the wrapper stays out of the
optimizer, state dicts and checkpoints (a checkpoint loads into zero=0 without fp8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.checkpoint import checkpoints, dcp
from tessera.config import load_config
from tessera.testing import run_ranks
from training_runs import train_histories

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (name, (dp, tp), layer, in features, out features, bias); FSDP shards the TP-local weight's rows
LAYERS = [("column tp2 dp2", (2, 2), "column", 32, 6, True),  # [3, 32]: 2 rows and 1 (padded)
          ("row tp2 dp2", (2, 2), "row", 12, 5, False),  # [5, 6]: 3 rows and 2
          ("column dp4", (4, 1), "column", 32, 3, False)]  # [3, 32] over dp 4: rank 3 holds none


def _recorder():
    """FSDP's all-gather, recording each call's input dtype and bytes."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Recorder(DefaultAllGather):
        def __init__(self):
            self.calls = []

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.calls.append((input_tensor.dtype, input_tensor.numel() * input_tensor.element_size()))
            return super().__call__(output_tensor, input_tensor, group, async_op)
    return Recorder()


def _make_layer(kind: str, in_features: int, out_features: int, bias: bool, tp_group, dtype):
    """A tensorwise fp8 layer, its weights drawn from one seed and rounded to ``dtype``."""
    from tessera.precision.fp8 import Float8Recipe
    from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    make = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = make(in_features, out_features, tp_group=tp_group, bias=bias, fp8=Float8Recipe("tensorwise"))
    layer.reset_parameters(torch.Generator().manual_seed(3))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((p + 0.5).to(dtype))  # (a zero bias would gather as zeros either way)
    return layer


def _layer_worker(rank: int, world: int) -> dict:
    """Each LAYERS case in fp32 and bf16, sharded by FSDP twice, gathering train.dtype and fp8:
    the bytes each all-gather moved, whether the fp8-gathered weight and factor equal ``quantize``
    of the train.dtype-gathered weight (dynamic and precomputed scales), and whether the two
    layers' outputs and gradients are equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tessera.distributed.fsdp_fp8 import Float8GatherScales, Float8ShardWeight, Float8Weight, gather_in_fp8
    from tessera.precision.fp8 import E4M3, quantize

    out = {}
    for name, (dp, tp), kind, in_features, out_features, bias in LAYERS:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_group = mesh["dp"], (mesh["tp"].get_group() if tp > 1 else None)
        for dname, dtype in DTYPES.items():
            policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype,
                                          reduce_dtype=torch.float32)
            layers, recorders = [], []
            for fp8_gather in (False, True):
                layer = _make_layer(kind, in_features, out_features, bias, tp_group, dtype)
                if fp8_gather:
                    gather_in_fp8(layer, tp_group)
                fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=True)
                recorders.append(_recorder())
                layer.set_custom_all_gather(recorders[-1])
                layers.append(layer)
            ref, fp8 = layers
            r = {}

            def gathered_equal():
                ref.unshard()
                fp8.unshard()
                q, inv = quantize(ref.weight, E4M3, (0, 1), True, tp_group)
                wq, ws = fp8.weight.fp8()
                same = (type(fp8.weight) is Float8Weight and wq.dtype == E4M3
                        and torch.equal(wq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ws, inv))
                ref.reshard()
                fp8.reshard()
                return same
            r["dynamic"] = gathered_equal()
            scales = Float8GatherScales([fp8.weight], dp_mesh.get_group(), tp_group, dtype)
            scales.refresh()
            r["precomputed"] = gathered_equal()
            scales.invalidate()
            g = torch.Generator().manual_seed(5 + dp_mesh.get_local_rank())
            x = torch.randn(4, 2, fp8.weight.shape[1], generator=g).to(dtype)  # [s, b, in/tp for a row layer]
            grad = torch.randn(4, 2, fp8.weight.shape[0], generator=g).to(dtype)  # [s, b, out/tp | out]
            results, kept = [], []
            for layer in (ref, fp8):
                xi, saved = x.clone().requires_grad_(), []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    y = layer(xi)
                # the e4m3 weight the backward will use: the layer's own cast, or FSDP's gathered
                # bytes, freed after the forward (storage resized to 0) and gathered again for it
                kept.append(sum(t.untyped_storage().nbytes() for t in saved if type(t) is torch.Tensor
                                and t.dtype == E4M3 and t.shape == layer.weight.shape))
                y.backward(grad)
                results.append((y.detach(), xi.grad, layer.weight.grad.full_tensor()))
            r["same_training"] = all(torch.equal(a, b) for a, b in zip(*results))
            r["no_fp8_weight_kept"] = kept[0] > 0 and kept[1] == 0
            r["calls"] = [rec.calls for rec in recorders]
            # nothing but FSDP sees the wrapper: the optimizer's moments, state dicts
            local = fp8.weight.to_local()
            r["wrapped"] = type(local) is Float8ShardWeight
            r["plain_moment"] = type(torch.zeros_like(fp8.weight).to_local()) is torch.Tensor
            state = fp8.state_dict()["weight"]
            r["plain_state"] = type(state.to_local()) is torch.Tensor and torch.equal(state.to_local(), local._tensor)
            # a load through the state dict writes the shard and drops a precomputed scale
            scales.refresh()
            for layer in (ref, fp8):
                layer.load_state_dict({k: v * 2 if k == "weight" else v for k, v in layer.state_dict().items()})
            r["load_drops_scale"] = local._scale.amax is None
            r["loaded"] = gathered_equal()
            out[name, dname] = r
    return out


@pytest.mark.timeout(240)
def test_fsdp_gathers_fp8_bytes_equal_to_quantizing_the_gathered_weight():
    """tp=2 x dp=2 (the scale's amax over dp and TP) and dp=4 (a rank with no rows), fp32 and
    bf16: each all-gather of an fp8 weight moves e4m3 bytes (a quarter of fp32's, half of bf16's),
    bit-equal, with the factor, to quantizing the weight FSDP gathers in train.dtype; layers
    gathered either way train alike bit for bit, and the fp8-gathered one keeps no fp8 copy of its
    weight between forward and backward; state dicts and the optimizer see plain tensors."""
    by_rank = run_ranks(_layer_worker, 4, timeout=200)
    for out in by_rank:
        for (name, dname), r in out.items():
            what = f"{name} {dname}"
            _, (dp, tp), kind, in_features, out_features, bias = next(c for c in LAYERS if c[0] == name)
            rows, cols = (out_features // tp, in_features) if kind == "column" else (out_features, in_features // tp)
            size = DTYPES[dname].itemsize
            per_rank = -(-rows // dp)  # torch.chunk's rows per rank, padded
            weight, bias_elems = per_rank * cols, per_rank if bias else 0
            ref_calls, fp8_calls = r["calls"]
            assert len(ref_calls) >= 3 and len(fp8_calls) >= len(ref_calls), what
            assert set(ref_calls) == {(DTYPES[dname], (weight + bias_elems) * size)}, what
            assert set(fp8_calls) == {(torch.uint8, weight + bias_elems * size)}, what  # (e4m3 as bytes)
            for key in ("dynamic", "precomputed", "same_training", "no_fp8_weight_kept", "wrapped", "plain_moment", "plain_state",
                        "load_drops_scale", "loaded"):
                assert r[key], (what, key)


# -- training ----------------------------------------------------------------------------------------------
STEPS = 8


def _train_worker(rank: int, world: int, runs: list[tuple[list[str], bool | None]]) -> list[tuple]:
    """Each run's (loss, gradient norm) per step, and its weights gathered in fp8 and how often one
    was read dequantized: training_runs' tiny model and batches with ``train.fp8=tensorwise`` and
    ``overrides``; ``fp8_gather`` overrides the plan's ``fp8_param_gather`` (None: as planned)."""
    from tessera.distributed.fsdp_fp8 import Float8ShardWeight, Float8Weight
    from tessera.topology import Topology
    from tessera.training.build import build
    from tessera.training.plan import make_plan
    from tessera.training.preflight import validate
    from tessera.training.step import train_step
    from training_runs import BASE, GLOBAL, my_micro_batches

    dequantized = []
    dequantize = Float8Weight.dequantize
    Float8Weight.dequantize = lambda self: (dequantized.append(1), dequantize(self))[1]
    out = []
    for overrides, fp8_gather in runs:
        dequantized.clear()
        cfg = load_config(None, BASE + ["train.fp8=tensorwise", *overrides])
        topo = Topology.build(tp=cfg.parallel.tp, dp=cfg.parallel.dp)
        cfg = validate(cfg, topo.world_size)
        plan = make_plan(cfg, topo.device)
        if fp8_gather is not None:
            plan = dataclasses.replace(plan, fp8_param_gather=fp8_gather)
        parts = build(cfg, topo, plan)
        micro = cfg.train.micro_batch
        history = []
        for step in range(STEPS):
            batches = my_micro_batches(step, topo, micro)
            r = train_step(parts.optimizer, batches, topo, parts.executor(GLOBAL // (micro * topo.dp)),
                           parts.data_parallel, clip_grad=cfg.optim.clip_grad)
            history.append((r.loss, r.grad_norm))
        with torch.no_grad():
            wrapped = sum(isinstance(p.to_local(), Float8ShardWeight) for c in parts.chunks for p in c.parameters()
                          if cfg.parallel.zero == 3)
        out.append((history, wrapped, len(dequantized)))
    return out


@pytest.mark.slow  # (the module's quickest multi-rank test stays in the fast subset)
@pytest.mark.timeout(300)
def test_zero3_with_fp8_gathers_trains_as_one_process_and_as_the_train_dtype_gather():
    """dp=2 zero=3, fp32 around the fp8 GEMMs, one micro-batch per rank (FSDP's sum of the two
    ranks' gradients is one process's sum of its two micro-batches'): the losses of 8 steps within
    1e-5 of fp8 at one process. With several micro-batches per rank FSDP reduces each one (another
    order of the sum, which fp8's rounding can amplify), so there the check is against the same
    run gathering train.dtype: bit for bit, in fp32 and bf16."""
    from tessera.training.plan import make_plan

    zero3 = load_config(None, ["parallel.zero=3", "parallel.dp=2", "train.fp8=tensorwise"])
    assert make_plan(zero3, torch.device("cpu")).fp8_param_gather  # planned for zero=3 tensorwise
    rowwise = load_config(None, ["parallel.zero=3", "parallel.dp=2", "train.fp8=rowwise"])
    assert not make_plan(rowwise, torch.device("cpu")).fp8_param_gather  # rowwise gathers train.dtype

    one, _, _ = run_ranks(_train_worker, 1, [(["train.micro_batch=4"], None)], timeout=120)[0][0]
    zero3 = ["parallel.zero=3"]
    runs = [(zero3 + ["train.micro_batch=4"], None),
            (zero3, True), (zero3, False), (zero3 + ["train.dtype=bf16"], True), (zero3 + ["train.dtype=bf16"], False)]
    (fsdp, wrapped, dequantized), *pairs = run_ranks(_train_worker, 2, runs, timeout=240)[0]
    assert wrapped == 2 * 4 and dequantized == 0  # QKV, projection, fc1, fc2 of 2 layers, used as gathered
    for step, (a, b) in enumerate(zip(one, fsdp)):
        assert b[0] == pytest.approx(a[0], rel=1e-5), (step, a, b)
        assert b[1] == pytest.approx(a[1], rel=1e-5), (step, a, b)
    for fp8_gathered, dtype_gathered in (pairs[:2], pairs[2:]):
        assert fp8_gathered[1:] == (8, 0) and dtype_gathered[1] == 0
        assert fp8_gathered[0] == dtype_gathered[0]


# -- checkpoints -------------------------------------------------------------------------------------------
CKPT = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=16", "model.vocab_size=64",
        "train.micro_batch=2", "train.global_batch=8", "train.seed=5", "train.log_every=1", "train.steps=4",
        "data.source=synthetic", "optim.lr=3e-3", "optim.warmup=1"]
FP8_ZERO3 = ["parallel.zero=3", "train.fp8=tensorwise"]


def _load_and_save(rank: int, world: int, overrides: list[str], src: str, dst: str) -> int:
    """``src`` loaded into the layout of ``overrides`` and saved again, untrained, into ``dst``."""
    from tessera.checkpoint import Checkpointer
    from tessera.optim import LRScheduler
    from tessera.topology import Topology
    from tessera.training.build import build
    from tessera.training.data_feed import DataFeed
    from tessera.training.preflight import validate

    cfg = load_config(None, CKPT + overrides + [f"checkpoint.dir={dst}"])
    topo = Topology.build(dp=cfg.parallel.dp)
    cfg = validate(cfg, topo.world_size)
    parts = build(cfg, topo)
    checkpointer = Checkpointer(cfg, topo, parts.chunks, parts.data_parallel, parts.optimizer, parts.rng,
                                log=lambda line: None)
    scheduler, data = LRScheduler(cfg.optim, cfg.train.steps), DataFeed(cfg, topo)
    step, _ = checkpointer.load(src, scheduler, data, None)
    checkpointer.save(step, scheduler, data, None)
    return step


@pytest.mark.slow  # (the module's quickest multi-rank test stays in the fast subset)
@pytest.mark.timeout(300)
def test_a_zero3_fp8_checkpoint_resumes_bit_for_bit_and_loads_into_zero0_without_fp8(tmp_path):
    """Saved from dp=2 zero=3 with the fp8 gather: resumed on that layout the run continues bit
    for bit; loaded into one process at zero=0 without fp8 and saved again, its tensors are the
    same bytes (plain fp32 main parameters and moments); and the run goes on there."""
    straight, resumed = train_histories(2, CKPT, [
        FP8_ZERO3 + ["checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/a", f"train.out_dir={tmp_path}/oa"],
        FP8_ZERO3 + [f"checkpoint.load={tmp_path}/a/step_00000002", f"checkpoint.dir={tmp_path}/b",
                     f"train.out_dir={tmp_path}/ob"]], timeout=240)
    assert [s for s, _ in checkpoints(f"{tmp_path}/a")] == [2, 4]
    keys = ("loss", "grad_norm", "lr")
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in straight[2:]]
    a, b = dcp.read_whole(f"{tmp_path}/a/step_00000004", ""), dcp.read_whole(f"{tmp_path}/b/step_00000004", "")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    src = f"{tmp_path}/a/step_00000002"
    assert run_ranks(_load_and_save, 1, ["train.fp8=none"], src, f"{tmp_path}/one", timeout=120) == [2]
    saved, again = dcp.read_whole(src, ""), dcp.read_whole(f"{tmp_path}/one/step_00000002", "")
    assert saved.keys() == again.keys() and any(k.startswith("optim.exp_avg.") for k in saved)
    for key in saved:
        assert saved[key].dtype == torch.float32 and torch.equal(again[key], saved[key]), key
    plain = train_histories(1, CKPT, [[f"checkpoint.load={src}", f"train.out_dir={tmp_path}/oc"]], timeout=120)[0]
    assert [m["step"] for m in plain] == [3, 4]
    # without fp8 the GEMMs round less: near the fp8 run's losses, not equal to them
    for m, n in zip(plain, straight[2:]):
        assert m["loss"] != n["loss"] and m["loss"] == pytest.approx(n["loss"], rel=1e-2)
