"""Where a step's time goes (training/timers.py, monitor.py, energy.py): the phases add up to the
step, each holds its own part, pipeline waits are cut out of the compute, the min and max over
ranks are gathered at log intervals, a rank slowed on purpose is named as a straggler, and the
energy figures come from the meter.

Time here is a clock the test moves itself (``HookClock``): each layer's forward and backward and
the optimizer step advance it by known units through torch's own hooks, and nothing else does, so
every figure is known exactly and no test depends on how fast this machine is."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tessera.config import load_config
from tessera.testing import run_ranks
from tessera.training.monitor import Monitor, find_stragglers
from tessera.training.timers import PhaseTimer

BASE = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.seq_len=16", "model.vocab_size=64",
        "train.micro_batch=1", "train.seed=5", "train.log_every=1", "train.steps=4", "data.source=synthetic",
        "train.sample_tokens=0", "train.device=cpu"]
PHASES = ("data", "forward_backward", "pipeline_wait", "dp_wait", "optimizer")


class HookClock:
    """Time that moves only when told (``advance``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, units: float) -> None:
        self.now += units


def _trainer_on_clock(rank: int, world: int, overrides: list[str], units: dict, tmp: str):
    """The trainer over this rank's parts, on a HookClock moved by ``units[rank]`` = (per layer
    forward, per layer backward, per optimizer step). (history, printed text, one direct step's
    span names)."""
    from tessera.training.build import build, build_topology
    from tessera.training.data_feed import DataFeed
    from tessera.training.metrics import JsonlLogger, NullLogger
    from tessera.training.plan import make_plan
    from tessera.training.preflight import validate
    from tessera.training.step import train_step
    from tessera.training.trainer import Trainer

    cfg = validate(load_config(None, BASE + overrides + [f"train.out_dir={tmp}"]), world)
    device = torch.device("cpu")
    topo = build_topology(cfg, device)
    parts = build(cfg, topo, make_plan(cfg, device))
    clock = HookClock()
    forward, backward, optimizer = units[rank]
    for chunk in parts.chunks:
        for layer in chunk.layers.values():
            layer.register_forward_hook(lambda *_: clock.advance(forward))
            layer.register_full_backward_hook(lambda *_: clock.advance(backward))
    parts.optimizer.inner.register_step_pre_hook(lambda *_: clock.advance(optimizer))
    logs = topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        logger = JsonlLogger(tmp, cfg.train.log_every) if logs else NullLogger()
        try:
            history = Trainer(cfg, parts, logger, logs=logs, world=world, clock=clock).run()
        finally:
            logger.close()
    # one more step, its spans' names: where the executor timed its waits
    timer = PhaseTimer(device, clock)
    micro_batches = DataFeed(cfg, topo).next()
    train_step(parts.optimizer, micro_batches, topo, parts.executor(len(micro_batches)), parts.data_parallel,
               clip_grad=1.0, timer=timer)
    return history, out.getvalue(), timer.take().names


def test_a_nested_span_counts_for_itself_only():
    clock = HookClock()
    timer = PhaseTimer(torch.device("cpu"), clock)
    with timer.span("data"):
        clock.advance(2)
    with timer.span("forward_backward"):
        clock.advance(5)
        with timer.span("pipeline_wait"):
            clock.advance(3)
        clock.advance(1)
        with timer.span("pipeline_wait"):
            clock.advance(4)
    step = timer.take()
    assert step.seconds() == {"data": 2, "forward_backward": 6, "pipeline_wait": 7}
    assert step.names == [("data", None), ("forward_backward", None), ("pipeline_wait", "forward_backward"),
                          ("pipeline_wait", "forward_backward")]
    assert timer.take().seconds() == {}  # (taken: the next step starts empty)


def test_the_phases_add_up_to_the_step_and_each_holds_its_own_part(tmp_path):
    """One process, 2 layers, 4 micro-batches a step: forward_backward = 4 x 2 x (3 + 5) units,
    the optimizer 7, nothing else moves the clock: they add up to each step's time exactly."""
    history, printed, _ = _trainer_on_clock(0, 1, ["train.global_batch=4"], {0: (3, 5, 7)}, str(tmp_path))
    assert len(history) == 4
    for m in history:
        assert m["forward_backward_s_min"] == m["forward_backward_s_max"] == 4 * 2 * (3 + 5)
        assert m["optimizer_s_max"] == 7 and m["data_s_max"] == 0 and m["dp_wait_s_max"] == 0
        assert "pipeline_wait_s_max" not in m  # (pp=1)
        assert sum(m[f"{p}_s_max"] for p in PHASES if f"{p}_s_max" in m) == m["step_time_s"] == 4 * 16 + 7
    assert "timers (s per step over the last 1): data 0 | forward-backward 64 | dp wait 0 | optimizer 7" in printed


def _stage_runs(rank, world, tmp):
    return _trainer_on_clock(rank, world, ["parallel.pp=2", "train.global_batch=4", "train.straggler_every=2"],
                             {0: (10, 20, 7), 1: (30, 40, 7)}, tmp)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipeline_ranks_report_min_and_max_and_their_waits_apart_from_compute(tmp_path):
    """pp=2, one layer per stage, 4 micro-batches: the first stage computes 4 x (10 + 20) units a
    step, the last 4 x (30 + 40); the logging (last) stage's line carries both as min and max. A
    pipeline wait moves no hook, so it is 0 here, and the compute is the hooks' units exactly:
    the waits are cut out of forward_backward. The two stages are not compared for stragglers
    (their work differs by design)."""
    (_, _, names0), (history, printed, names1) = run_ranks(_stage_runs, 2, str(tmp_path), timeout=220)
    for m in history:
        assert (m["forward_backward_s_min"], m["forward_backward_s_max"]) == (4 * 30, 4 * 70)
        assert m["pipeline_wait_s_max"] == 0 and m["optimizer_s_min"] == m["optimizer_s_max"] == 7
        assert m["step_time_s"] == 4 * 70 + 7  # (the logging rank's own: its phases' sum)
    assert [m.get("stragglers") for m in history] == [None, 0, None, 0]
    assert "straggler" not in printed and "min-max over 2 ranks" in printed
    for names in (names0, names1):  # one timed wait per received activation (stage 1) or gradient (stage 0)
        assert names.count(("pipeline_wait", "forward_backward")) == 4
        assert [n for n in names if n[1] is None] == [("dp_wait", None), ("forward_backward", None),
                                                      ("dp_wait", None), ("optimizer", None)]


def _dp_runs(rank, world, tmp):
    units = {0: (1, 2, 1), 1: (1, 2, 1), 2: (3, 6, 3)}  # rank 2 three times slower than the others
    return _trainer_on_clock(rank, world, ["parallel.dp=3", "train.global_batch=6", "train.straggler_every=2",
                                           "train.straggler_margin=0.5"], units, tmp)


@pytest.mark.timeout(240)
def test_a_rank_slowed_on_purpose_is_named_as_a_straggler(tmp_path):
    (history, printed, _), *_ = run_ranks(_dp_runs, 3, str(tmp_path), timeout=220)
    assert [m.get("straggler_ranks") for m in history] == [None, [2], None, [2]]
    assert [m.get("stragglers") for m in history] == [None, 1, None, 1]
    work = 2 * 2 * (3 + 6) + 3  # 2 micro-batches x 2 layers x (forward + backward) + the optimizer
    median = 2 * 2 * (1 + 2) + 1
    assert (f"tessera: straggler over steps 3-4: rank 2 works {work:.3g} s per step, "
            f"{100 * (work / median - 1):.0f} % over the median {median:.3g} s of its pipeline stage's ranks "
            "(train.straggler_margin=0.5)") in printed
    assert history[0]["forward_backward_s_min"] == 2 * 2 * 3 and history[0]["forward_backward_s_max"] == 2 * 2 * 9


def test_stragglers_are_compared_within_their_pipeline_stage():
    assert find_stragglers([1.0, 1.0, 1.3, 1.0], [0, 0, 0, 0], margin=0.2) == [2]
    assert find_stragglers([1.0, 1.0, 1.2, 1.0], [0, 0, 0, 0], margin=0.2) == []  # (not more than the margin)
    # stage 1 works twice as much as stage 0 by design: no one is named for it
    assert find_stragglers([1.0, 1.0, 2.0, 2.0], [0, 0, 1, 1], margin=0.2) == []
    assert find_stragglers([1.0, 1.0, 2.0, 3.0], [0, 0, 1, 1], margin=0.1) == [3]
    assert find_stragglers([5.0], [0], margin=0.1) == []  # (alone in its stage)


class FakeMeter:
    def __init__(self):
        self.total = 1000.0

    def joules(self) -> float:
        return self.total


def test_energy_per_step_and_per_token_come_from_the_meter():
    meter = FakeMeter()
    monitor = Monitor(rank=0, world=1, pp=1, pp_rank=0, log_every=2, steps=10, straggler_every=0,
                      straggler_margin=0.2, energy=meter)
    meter.total += 300.0
    assert monitor.step_done(1, {"forward_backward": 1.0}, processed=100) == {}  # (not a log step)
    meter.total += 500.0
    metrics = monitor.step_done(2, {"forward_backward": 3.0}, processed=100)
    assert metrics["energy_j_per_step"] == 400.0 and metrics["energy_j_per_token"] == 4.0
    assert metrics["forward_backward_s_max"] == 2.0  # (the mean per step over the interval)
    assert "energy 400 J/step, 4 J/token" in monitor.take_lines()[0]
    no_meter = Monitor(rank=0, world=1, pp=1, pp_rank=0, log_every=1, steps=10, straggler_every=0,
                       straggler_margin=0.2)
    assert not any(k.startswith("energy") for k in no_meter.step_done(1, {}, processed=1))


def test_no_energy_meter_off_a_gpu():
    from tessera.training.energy import EnergyMeter

    assert EnergyMeter.for_device(torch.device("cpu")) is None


@pytest.mark.gpu
def test_a_gpus_energy_counter_is_read_through_nvml():
    pytest.importorskip("pynvml")
    from tessera.training.energy import EnergyMeter

    meter = EnergyMeter.for_device(torch.device("cuda", 0))
    assert meter is not None, "NVML is installed but the GPU's energy counter could not be read"
    before = meter.joules()
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(50):
        x = (x @ x).clamp(-1, 1)
    torch.cuda.synchronize()
    assert meter.joules() > before
