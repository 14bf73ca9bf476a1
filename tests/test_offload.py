"""parallel.optimizer_offload: AdamW's fp32 main parameters and moments in host memory, the update
on the CPU. On gloo ranks it trains as the optimizer on the device to 1e-6 (the CPU's fused AdamW
against the CPU's foreach one), with zero 0-2 and fp32 or bf16 parameters; its checkpoints resume
without offload and back; the memory report and model count its state as host bytes."""

from __future__ import annotations

import functools

import pytest
import torch

from tessera.config import ConfigError, load_config
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.memory_model import model_state
from tessera.training.preflight import validate
from training_runs import BASE, train_histories, train_run

LAYOUTS = [(zero, dtype) for zero in (0, 1, 2) for dtype in ("fp32", "bf16")]


def _worker(rank: int, world: int) -> dict:
    out = {}
    for zero, dtype in LAYOUTS:
        for offload in (False, True):
            sets = [f"parallel.zero={zero}", f"train.dtype={dtype}", f"parallel.optimizer_offload={str(offload).lower()}"]
            topo = Topology.build()
            run = train_run(topo, sets)
            cfg = validate(load_config(None, BASE + sets), world)
            run["predicted"] = model_state(cfg, topo.pp_rank, topo.dp_rank)
            out[(zero, dtype, offload)] = run
    return out


@functools.cache
def runs() -> list[dict]:
    return run_ranks(_worker, 2, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("zero,dtype", LAYOUTS)
def test_offloaded_update_trains_as_the_device_one(zero, dtype):
    for rank in runs():
        on, off = rank[(zero, dtype, True)], rank[(zero, dtype, False)]
        # (the CPU's fused AdamW and its foreach one round a few elements differently: 1e-6)
        assert on["losses"] == pytest.approx(off["losses"], rel=1e-6, abs=0), (zero, dtype)
        assert on["norms"] == pytest.approx(off["norms"], rel=1e-6, abs=0), (zero, dtype)
        assert on["params"].keys() == off["params"].keys()
        for name, value in on["params"].items():
            torch.testing.assert_close(value, off["params"][name], rtol=1e-6, atol=1e-6, msg=name)
        assert on["skipped"] == off["skipped"]
        if dtype == "bf16":  # (the last bits above vanish in the bf16 model's rounding: equal to the bit)
            assert on["losses"] == off["losses"] and all(torch.equal(v, off["params"][n]) for n, v in on["params"].items())


@pytest.mark.slow
def test_offloaded_state_is_host_memory_in_the_report_and_the_model():
    for rank in runs():
        for zero, dtype in LAYOUTS:
            on, off = rank[(zero, dtype, True)]["memory"], rank[(zero, dtype, False)]["memory"]
            assert on == rank[(zero, dtype, True)]["predicted"], (zero, dtype)  # to the byte
            assert off == rank[(zero, dtype, False)]["predicted"], (zero, dtype)
            assert on.main_params == on.optimizer_state == 0 and (on.params, on.grads) == (off.params, off.grads)
            assert off.host == 0 and on.total == off.total - off.main_params - off.optimizer_state
            # host: fp32 main params (an fp32 model's too), Adam's two moments, two gradient staging
            # buffers of one range each (tests/test_offload_staging.py counts them exactly)
            shard = off.optimizer_state // 8
            assert 12 * shard < on.host < 16 * shard, (zero, dtype, str(on))


def test_offload_with_fsdp_is_refused_in_words():
    with pytest.raises(ConfigError, match="parallel.optimizer_offload: zero=3 .* -> use parallel.zero=1 or 2"):
        load_config(None, ["parallel.zero=3", "parallel.optimizer_offload=true"])


CKPT = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=1", "train.global_batch=8", "train.seed=3", "train.log_every=1", "data.source=synthetic",
        "optim.lr=1e-2", "optim.warmup=2", "optim.clip_grad=0.5", "parallel.bucket_size=700", "train.dtype=bf16",
        "parallel.zero=1", "train.steps=5"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_offloaded_checkpoint_resumes_without_offload_and_back(tmp_path):
    on, off = "parallel.optimizer_offload=true", "parallel.optimizer_offload=false"
    runs = [[on, "checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/a", f"train.out_dir={tmp_path}/oa"],
            [off, f"checkpoint.load={tmp_path}/a/step_00000002", f"train.out_dir={tmp_path}/ob"],
            [off, "checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/c", f"train.out_dir={tmp_path}/oc"],
            [on, f"checkpoint.load={tmp_path}/c/step_00000002", f"train.out_dir={tmp_path}/od"]]
    straight_on, resumed_off, straight_off, resumed_on = train_histories(2, CKPT, runs)

    def curve(history):
        return [(m["step"], m["loss"], m["grad_norm"]) for m in history]

    assert curve(straight_on) == curve(straight_off)
    assert curve(resumed_off) == curve(straight_on)[2:] and curve(resumed_on) == curve(straight_off)[2:]
