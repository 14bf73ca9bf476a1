"""Schedules: each learning-rate decay style and weight-decay increment follows its formula
(values hand-computed at chosen steps), apply() sets the optimizer's groups, the micro-batch
calculator ramps the global batch, and every state dict round-trips or refuses other settings."""

import math

import pytest
import torch

from tessera.config import ConfigError, OptimConfig, load_config
from tessera.optim import LRScheduler, MicroBatchCalculator
from tessera.training.preflight import validate


def sched(style, total=20, **kw):
    return LRScheduler(OptimConfig(lr=1.0, min_lr=0.1, warmup=4, decay_style=style, **kw), total)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "wsd"])
def test_warmup_is_linear_from_zero(style):
    assert [sched(style).lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_constant_stays_at_lr():
    assert [sched("constant").lr(s) for s in (4, 12, 20, 100)] == [1.0] * 4


def test_linear_and_cosine_decay():
    # D = 20, warmup 4: progress p = (step - 4) / 16.
    lin, cos = sched("linear"), sched("cosine")
    assert lin.lr(4) == 1.0 and lin.lr(12) == pytest.approx(0.55) and lin.lr(8) == pytest.approx(0.775)
    assert cos.lr(4) == 1.0 and cos.lr(12) == pytest.approx(0.55)
    assert cos.lr(8) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    for s in (lin, cos):
        assert s.lr(20) == 0.1 and s.lr(100) == 0.1
        values = [s.lr(step) for step in range(3, 25)]
        assert all(a >= b for a, b in zip(values, values[1:]))


def test_decay_steps_overrides_total_steps():
    s = sched("linear", total=1000, decay_steps=20)
    assert s.lr(12) == pytest.approx(0.55) and s.lr(500) == 0.1


def test_inverse_square_root():
    # lr * sqrt(4) / sqrt(step), floored at min_lr = 0.1; decay_steps plays no part.
    s = sched("inverse-square-root")
    assert [s.lr(step) for step in (4, 16, 64, 400)] == pytest.approx([1.0, 0.5, 0.25, 0.1])
    assert s.lr(10_000) == 0.1
    no_warmup = LRScheduler(OptimConfig(lr=1.0, min_lr=0.0, warmup=0, decay_style="inverse-square-root"), 20)
    assert no_warmup.lr(0) == 1.0 and no_warmup.lr(4) == pytest.approx(0.5)


def test_wsd_stable_then_linear_decay():
    s = sched("wsd", wsd_decay_steps=8)  # stable to step 12, then linear 1.0 -> 0.1 by step 20
    assert all(s.lr(step) == 1.0 for step in range(4, 13))
    assert s.lr(16) == pytest.approx(0.55) and s.lr(20) == 0.1 and s.lr(50) == 0.1
    values = [s.lr(step) for step in range(12, 21)]
    assert all(a > b for a, b in zip(values, values[1:]))
    default = sched("wsd")  # 10% of the 16 decay steps, rounded: 2
    assert default.wsd_steps == 2 and default.lr(17) == 1.0 and default.lr(19) == pytest.approx(0.55)
    with pytest.raises(ConfigError) as info:
        sched("wsd", wsd_decay_steps=17)
    assert info.value.key == "optim.wsd_decay_steps"


def test_weight_decay_increment():
    const = LRScheduler(OptimConfig(weight_decay=0.05), 20)
    assert const.weight_decay(0) == const.weight_decay(19) == 0.05
    kw = dict(start_weight_decay=0.0, end_weight_decay=0.1)
    lin = LRScheduler(OptimConfig(weight_decay_incr_style="linear", **kw), 20)
    assert [lin.weight_decay(s) for s in (0, 10, 20, 40)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    cos = LRScheduler(OptimConfig(weight_decay_incr_style="cosine", **kw), 20)
    assert cos.weight_decay(10) == pytest.approx(0.05) and cos.weight_decay(20) == pytest.approx(0.1)
    assert cos.weight_decay(5) == pytest.approx(0.05 * (1 - math.cos(math.pi / 4)))


def test_apply_sets_lr_everywhere_and_weight_decay_on_the_decay_group():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    s = LRScheduler(OptimConfig(lr=1.0, min_lr=0.1, warmup=4, weight_decay_incr_style="linear",
                                start_weight_decay=0.0, end_weight_decay=0.2), 20)
    assert s.apply(opt, 0) == 0.25
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    s.apply(opt, 10)  # the decay group passed through 0 above and still counts as decaying
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.1, 0.0])
    assert opt.param_groups[0]["lr"] == pytest.approx(s.lr(10))


def test_a_weight_decay_schedule_applies_where_optim_weight_decay_is_0():
    """The linear and cosine styles ignore optim.weight_decay (the constant style's value): at 0,
    the matrices' group still follows the schedule, the vectors' group never decays."""
    from torch import nn

    from tessera.optim.optimizers import _decay_groups

    w, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    cfg = OptimConfig(weight_decay=0.0, weight_decay_incr_style="linear", start_weight_decay=0.0,
                      end_weight_decay=0.1)
    opt = torch.optim.AdamW(_decay_groups([(w, w), (b, b)], cfg))
    s = LRScheduler(cfg, 10)
    for step, want in ((0, 0.0), (5, 0.05), (10, 0.1)):
        s.apply(opt, step)
        assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([want, 0.0]), step


def test_scheduler_state_round_trip_and_refusal():
    s = sched("wsd", wsd_decay_steps=8)
    sched("wsd", wsd_decay_steps=8).load_state_dict(s.state_dict())
    with pytest.raises(ConfigError) as info:
        sched("cosine").load_state_dict(s.state_dict())
    assert info.value.key == "optim.decay_style" and "'wsd'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        sched("wsd", total=30, wsd_decay_steps=8).load_state_dict(s.state_dict())
    assert info.value.key == "train.steps" and "optim.decay_steps=20" in info.value.fix
    # With the decay's end pinned by optim.decay_steps a run may be resumed for longer.
    pinned = sched("cosine", decay_steps=15)
    sched("cosine", total=40, decay_steps=15).load_state_dict(pinned.state_dict())
    # the same decay end, said another way (decay_steps=10, or 10 train.steps): the same schedule
    sched("cosine", total=10).load_state_dict(sched("cosine", total=5, decay_steps=10).state_dict())


def test_constant_global_batch():
    c = MicroBatchCalculator(16, 2, 2)
    assert c.global_batch(0) == c.global_batch(10**6) == 16 and c.num_micro_batches(0) == 4


def test_rampup_values():
    # 4 -> 16 by 4: three increments, one every 300 / 3 = 100 samples; full batch after 300.
    c = MicroBatchCalculator(16, 2, 2, (4, 4, 300))
    consumed = [0, 99, 100, 199, 200, 299, 300, 301, 10**6]
    assert [c.global_batch(n) for n in consumed] == [4, 4, 8, 8, 12, 12, 16, 16, 16]
    assert [c.num_micro_batches(n) for n in (0, 100, 200, 301)] == [1, 2, 3, 4]
    batches = [c.advance() for _ in range(40)]
    assert batches[:25] == [4] * 25 and batches[25] == 8 and c.consumed_samples == sum(batches)


@pytest.mark.parametrize("rampup,words", [
    ((4, 5, 300), "does not divide"),
    ((2, 2, 300), "start 2 is not divisible by micro_batch*dp = 2*2"),
    ((4, 6, 300), "increment 6 is not divisible"),
    ((20, 4, 300), "start <= global_batch"),
    ((4, 4, 0), "over 0 samples"),
])
def test_rampup_validation(rampup, words):
    with pytest.raises(ConfigError) as info:
        MicroBatchCalculator(16, 2, 2, rampup)
    assert info.value.key == "train.batch_rampup" and words in str(info.value) and info.value.fix


def test_micro_batch_state_round_trip_and_refusal():
    c = MicroBatchCalculator(16, 2, 2, (4, 4, 300))
    for _ in range(30):
        c.advance()
    other = MicroBatchCalculator(16, 4, 1, (4, 4, 300))  # another layout, the same batches
    other.load_state_dict(c.state_dict())
    assert other.consumed_samples == c.consumed_samples and other.advance() == c.advance()
    with pytest.raises(ConfigError) as info:
        MicroBatchCalculator(16, 2, 2, (8, 4, 300)).load_state_dict(c.state_dict())
    assert info.value.key == "train.batch_rampup"


@pytest.mark.parametrize("overrides,world,key,words", [
    (["optim.decay_style=exponential"], 1, "optim.decay_style", "constant, linear, cosine"),
    (["optim.weight_decay_incr_style=step"], 1, "optim.weight_decay_incr_style", "constant, linear"),
    (["optim.end_weight_decay=-1"], 1, "optim.end_weight_decay", "must be >= 0"),
    (["optim.wsd_decay_steps=-1"], 1, "optim.wsd_decay_steps", "must be >= 0"),
    (["train.batch_rampup=4,4"], 1, "train.batch_rampup", "not three integers"),
    (["train.batch_rampup=four,4,100"], 1, "train.batch_rampup", "not three integers"),
    (["train.batch_rampup=0,4,100"], 1, "train.batch_rampup", "start >= 1"),
    (["train.batch_rampup=4,5,100"], 1, "train.batch_rampup", "does not divide"),
    (["train.batch_rampup=32,4,100"], 1, "train.batch_rampup", "exceeds train.global_batch"),
    (["train.batch_rampup=4,4,0"], 1, "train.batch_rampup", "over 0 samples"),
    (["train.seed=-1"], 1, "train.seed", "outside [0, 2**62)"),
    (["train.batch_rampup=4,4,100", "train.micro_batch=2"], 4, "train.batch_rampup", "micro_batch*dp = 2*4"),
])
def test_bad_schedule_config_is_refused(overrides, world, key, words):
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, overrides), world)
    assert info.value.key == key and words in str(info.value) and info.value.fix


def test_rampup_config_accepted():
    cfg = validate(load_config(None, ["train.batch_rampup=4, 4, 100"]), 1)
    assert cfg.train.rampup == (4, 4, 100)
    assert MicroBatchCalculator.from_config(cfg.train, 1).global_batch(0) == 4


def test_rampup_grows_at_each_slice_boundary_exactly():
    # 2 -> 30 by 2 over 18 samples: 14 slices of 18/14 samples; 9 samples consumed end the 7th
    # slice exactly (9 * 14 / 18 = 7), so the batch is 2 + 2 * 7 (the float quotient gave 6.999...)
    c = MicroBatchCalculator(30, 2, 1, (2, 2, 18))
    assert c.global_batch(9) == 16
    for consumed in range(19):
        assert c.global_batch(consumed) == 2 + 2 * (consumed * 14 // 18), consumed


def test_wsd_decay_longer_than_the_run_is_refused_before_any_work():
    """check_runnable (what `tessera train --nproc-per-node` runs before starting torchrun)
    refuses it, not the trainer after every rank built its model."""
    from tessera.training.preflight import check_runnable

    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(None, ["optim.decay_style=wsd", "optim.wsd_decay_steps=100", "train.steps=20",
                                          "data.source=synthetic"]), 1)
    assert info.value.key == "optim.wsd_decay_steps" and "exceeds the 10 steps" in str(info.value)


@pytest.mark.parametrize("args,key", [((0, 2, 1), "train.global_batch"), ((-4, 2, 1), "train.global_batch"),
                                      ((8, 0, 1), "train.micro_batch"), ((8, 2, 0), "parallel.dp")])
def test_batch_sizes_below_one_are_refused(args, key):
    """A global batch of 0 was accepted (steps of no micro-batches), micro_batch or dp of 0 fell
    over as a ZeroDivisionError."""
    with pytest.raises(ConfigError) as info:
        MicroBatchCalculator(*args)
    assert info.value.key == key and ">= 1" in str(info.value) and info.value.fix
