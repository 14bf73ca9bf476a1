"""parallel.offload_overlap: the offloaded CPU update runs on a thread behind the next step's
forward (optim/overlap.py). It trains to the same bits as the update within the step (and, bf16,
as the optimizer on the device), also across a checkpoint's save and resume; the spans go in the
forward's order; a layer's forward waits for its own spans; an error on the thread is raised at
the next join; configurations that cannot overlap are refused in words, or left synchronous by auto."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from tessera.config import ConfigError, load_config
from tessera.distributed.readers import forward_readers
from tessera.optim.overlap import BackgroundUpdate
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.build import build
from tessera.training.plan import make_plan
from tessera.training.preflight import validate
from tessera.training.step import train_step
from training_runs import BASE, my_micro_batches, train_outputs, train_run

LAYOUTS = [(zero, dtype) for zero in (0, 1) for dtype in ("fp32", "bf16")]
MODES = {"device": [], "within": ["parallel.optimizer_offload=true", "parallel.offload_overlap=false"],
         "behind": ["parallel.optimizer_offload=true", "parallel.offload_overlap=true"]}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for zero, dtype in LAYOUTS:
        for mode, sets in MODES.items():
            run = train_run(Topology.build(), [f"parallel.zero={zero}", f"train.dtype={dtype}", *sets])
            out[(zero, dtype, mode)] = {k: run[k] for k in ("losses", "norms", "params", "skipped")}
    return out


@functools.cache
def runs() -> dict:
    return run_ranks(_worker, 1, timeout=300)[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("zero,dtype", LAYOUTS)
def test_the_update_behind_the_forward_trains_to_the_same_bits(zero, dtype):
    """5 steps of 8 accumulated micro-batches, clipped at 0.5, ranges of several spans."""
    device, within, behind = (runs()[(zero, dtype, mode)] for mode in MODES)
    assert behind["losses"] == within["losses"] and behind["norms"] == within["norms"]
    assert all(torch.equal(v, within["params"][n]) for n, v in behind["params"].items())
    if dtype == "bf16":  # (fp32: the CPU's fused AdamW and the foreach one differ by 1e-6: test_offload.py)
        assert behind["losses"] == device["losses"]
        assert all(torch.equal(v, device["params"][n]) for n, v in behind["params"].items())


CKPT = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=1", "train.global_batch=4", "train.seed=3", "train.log_every=1", "data.source=synthetic",
        "optim.lr=1e-2", "optim.warmup=2", "optim.clip_grad=0.5", "parallel.bucket_size=700", "train.dtype=bf16",
        "parallel.zero=1", "train.steps=5", "train.eval_every=2", "train.eval_batches=1",
        "parallel.optimizer_offload=true"]


@pytest.mark.timeout(400)
def test_a_checkpoint_in_the_middle_resumes_to_the_same_bits(tmp_path):
    """The trainer's joins: the save after step 2, the validation loss, the end; resumed behind the
    forward from the synchronous run's checkpoint and from its own."""
    behind, within = "parallel.offload_overlap=true", "parallel.offload_overlap=false"
    nan = ["train.inject_fault=nan", "train.inject_fault_step=3", "train.nonfinite=skip"]  # (the guard skips step 3 on the thread)
    runs = [[within, "checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/a", f"train.out_dir={tmp_path}/oa"],
            [behind, "checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/b", f"train.out_dir={tmp_path}/ob"],
            [behind, f"checkpoint.load={tmp_path}/a/step_00000002", f"train.out_dir={tmp_path}/oc"],
            [behind, f"checkpoint.load={tmp_path}/b/step_00000002", f"train.out_dir={tmp_path}/od"],
            [within, *nan, f"train.out_dir={tmp_path}/oe"], [behind, *nan, f"train.out_dir={tmp_path}/of"]]
    (straight, said_within), (overlapped, said), (from_within, _), (from_own, _), (skipped_within, _), \
        (skipped_behind, _) = train_outputs(1, CKPT, runs, 300)

    def curve(history):
        return [(m["step"], m["loss"], m["grad_norm"], m.get("valid_loss")) for m in history]

    assert "its update behind the next forward" in said and "its update finished within the step" in said_within
    assert curve(overlapped) == curve(straight)
    assert curve(from_within) == curve(straight)[2:] and curve(from_own) == curve(straight)[2:]
    assert [m["skipped"] for m in skipped_behind] == [False, False, True, False, False]
    assert str(curve(skipped_behind)) == str(curve(skipped_within)) and curve(skipped_behind)[:2] == curve(straight)[:2]


def _dp_worker(rank: int, world: int) -> dict:
    return {mode: train_run(Topology.build(), ["parallel.zero=0", "train.dtype=bf16", *MODES[mode]])
            for mode in ("within", "behind")}


@pytest.mark.timeout(300)
def test_zero_0_overlaps_with_dp_to_the_same_bits():
    """Every dp rank updates its whole replica: nothing is gathered after the update."""
    for rank in run_ranks(_dp_worker, 2, timeout=240):
        within, behind = rank["within"], rank["behind"]
        assert behind["losses"] == within["losses"] and behind["norms"] == within["norms"]
        assert all(torch.equal(v, within["params"][n]) for n, v in behind["params"].items())


def _build(sets: list[str]):
    topo = Topology.build()
    cfg = validate(load_config(None, BASE + ["parallel.optimizer_offload=true", *sets]), topo.world_size)
    return topo, cfg, build(cfg, topo, make_plan(cfg, topo.device))


def _step(topo, cfg, parts, step: int):
    batches = my_micro_batches(step, topo)
    return train_step(parts.optimizer, batches, topo, parts.executor(len(batches)), parts.data_parallel,
                      clip_grad=cfg.optim.clip_grad)


def _waits_worker(rank: int, world: int) -> dict:
    # the last layer's weight after step 1, from the update within the step
    topo, cfg, ref = _build(["parallel.offload_overlap=false"])
    _step(topo, cfg, ref, 0)
    last = str(cfg.model.layers - 1)
    expected = ref.chunks[0].layers[last].mlp.fc2.weight.detach().clone()

    topo, cfg, parts = _build(["parallel.offload_overlap=true"])
    chunk, opt = parts.chunks[0], parts.optimizer
    layer = chunk.layers[last]
    readers = {p: n for n, (_, params) in enumerate(forward_readers(chunk)) for p in params}
    arrived, log, seen, order, held = threading.Event(), [], {}, [], []

    def gate(adam, args, kwargs):  # on the thread: the last layer's own spans start once the forward reaches it
        updating = [p for t, *_, p in opt.pieces if t.grad is not None]
        order.append(min(readers[p] for p in updating))
        if set(updating) <= set(layer.parameters()) and len(order) <= len(opt.spans):
            held.append(arrived.is_set())
            arrived.wait()

    def arrive(module, args):  # before the optimizer's own wait
        if opt.background.running and not arrived.is_set():
            log.append("arrived")
            arrived.set()

    def read(module, args):  # after it: what the layer's forward reads
        if opt.background.running and "weight" not in seen:
            log.append("read")
            seen["weight"] = layer.mlp.fc2.weight.detach().clone()

    opt._worker.register_step_pre_hook(gate)
    layer.register_forward_pre_hook(arrive, prepend=True)
    layer.register_forward_pre_hook(read)
    _step(topo, cfg, parts, 0)  # its update starts behind the return
    _step(topo, cfg, parts, 1)  # whose forward reads the last layer after waiting for it
    opt.wait()
    return {"fresh": torch.equal(seen["weight"], expected), "log": log, "order": order, "spans": len(opt.spans),
            "held": held}


@pytest.mark.timeout(300)
def test_a_layer_waits_for_its_own_spans_updated_in_the_forward_order():
    """The thread holds the last layer's spans until the forward has reached that layer: the
    forward then waits there and reads the updated weights (no clock involved)."""
    out = run_ranks(_waits_worker, 1, timeout=240)[0]
    assert out["fresh"]
    assert out["log"] == ["arrived", "read"] and out["held"], out  # (held: some span was gated)
    assert out["spans"] > 2 and out["order"][:out["spans"]] == sorted(out["order"][:out["spans"]])


def _error_worker(rank: int, world: int) -> list[str]:
    topo, cfg, parts = _build(["parallel.offload_overlap=true"])
    calls = []

    def fail(adam, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("injected in the second span")

    parts.optimizer._worker.register_step_pre_hook(fail)
    _step(topo, cfg, parts, 0)  # returns: the update runs on
    said = []
    try:
        _step(topo, cfg, parts, 1)  # the first layer waiting for the failed span raises it
    except RuntimeError as e:
        said.append(str(e))
    parts.optimizer.wait()  # (raised once: nothing left to join)
    return said


@pytest.mark.timeout(300)
def test_an_error_on_the_thread_is_raised_at_the_next_join():
    (said,) = run_ranks(_error_worker, 1, timeout=240)[0]
    assert "parallel.offload_overlap" in said and "failed: ValueError: injected in the second span" in said


def test_wait_for_returns_only_after_the_span_is_done():
    update, gates, log = BackgroundUpdate(torch.device("cpu")), [threading.Event(), threading.Event()], []

    def work(done):
        for k, gate in enumerate(gates):
            gate.wait()
            log.append(f"done {k}")
            done(k)

    update.start(work, 2)
    gates[0].set()
    update.wait_for([0])
    assert log == ["done 0"]
    waiter = threading.Thread(target=lambda: (update.wait_for([1]), log.append("waited 1")))
    waiter.start()
    log.append("release 1")
    gates[1].set()
    waiter.join()
    update.join()
    assert log == ["done 0", "release 1", "done 1", "waited 1"]
    update.wait_for([0, 1])  # (joined: nothing to wait for)


def test_an_error_wakes_the_waiters_and_is_raised_once():
    update, gate = BackgroundUpdate(torch.device("cpu")), threading.Event()

    def work(done):
        done(0)
        gate.wait()
        raise OSError("disk on fire")

    update.start(work, 3)
    update.wait_for([0])
    gate.set()
    with pytest.raises(RuntimeError, match=r"offload_overlap\), failed: OSError: disk on fire"):
        update.wait_for([2])
    update.join()  # (raised already)


@pytest.mark.parametrize("sets,problem", [
    (["parallel.optimizer_offload=false"], "parallel.optimizer_offload is false"),
    (["parallel.zero=2"], "zero=2 with dp"),
    (["train.fp8=tensorwise"], "fp8 weight cache"),
    (["train.cuda_graphs=true"], "CUDA-graphed layers"),
])
def test_what_cannot_overlap_is_refused_in_words(sets, problem):
    cfg = load_config(None, BASE + ["parallel.optimizer_offload=true", "parallel.offload_overlap=true", *sets])
    with pytest.raises(ConfigError, match=f"parallel.offload_overlap: .*{problem}"):
        validate(cfg, 1)


def test_auto_overlaps_on_cuda_where_it_can_and_nowhere_else():
    def plan(device, *sets):
        cfg = validate(load_config(None, BASE + ["parallel.optimizer_offload=true", *sets]), 2)
        return make_plan(cfg, torch.device(device)).offload_overlap

    assert plan("cuda", "parallel.zero=0") and not plan("cpu", "parallel.zero=0")
    assert not plan("cuda", "parallel.zero=1") and plan("cuda", "parallel.zero=1", "parallel.pp=2")
    assert not plan("cuda", "parallel.zero=0", "parallel.offload_overlap=false")
    assert not plan("cuda", "parallel.zero=0", "parallel.tp=2")  # (tp > 1: CUDA graphs, which it gives way to)
