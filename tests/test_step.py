"""The training step on one process: token-weighted loss over micro-batches, fp16 overflow
handling, the learning-rate schedule."""

import math

import pytest
import torch

from tessera.config import ModelConfig, OptimConfig
from tessera.models import GPTModel
from tessera.distributed.data_parallel import DataParallel
from tessera.optim import DynamicLossScaler, learning_rate
from tessera.optim.optimizers import MainParamOptimizer
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.pipeline_parallel.schedules import build_schedule
from tessera.topology import Topology
from tessera.training.step import train_step

CFG = ModelConfig(hidden=32, layers=1, heads=2, seq_len=8, vocab_size=50)


def _model():
    model = GPTModel(CFG)
    model.init_weights(3)
    return model


def _optimizer(model):
    dp = DataParallel([model], Topology.build())
    return dp, MainParamOptimizer(dp, OptimConfig())


def _step(model, opt, micro_batches, **kw):
    """One step without pipelining: the executor running schedule 'none'."""
    executor = PipelineExecutor([model], build_schedule("none", 1, 1, len(micro_batches), 0), None, 1, 0)
    dp, optimizer = opt
    return train_step(optimizer, micro_batches, Topology.build(), executor, dp, **kw)


def _batch(rows, seed, mask_keep):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (rows, 9), generator=g)
    mask = torch.zeros(rows, 8)
    mask[:, :mask_keep] = 1.0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def test_accumulation_is_the_mean_over_all_tokens():
    # Two micro-batches with different numbers of valid tokens == one batch holding both.
    a, b = _batch(2, 1, mask_keep=8), _batch(2, 2, mask_keep=3)
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    m1, m2 = _model(), _model()
    o1, o2 = _optimizer(m1), _optimizer(m2)
    r1 = _step(m1, o1, [a, b], clip_grad=0.0)
    r2 = _step(m2, o2, [both], clip_grad=0.0)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-6) and r1.tokens == r2.tokens == 22
    assert r1.grad_norm == pytest.approx(r2.grad_norm, rel=1e-5)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2)


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = _optimizer(model)
    scaler = DynamicLossScaler(init_scale=1e39)  # loss * scale overflows to inf
    result = _step(model, opt, [_batch(2, 1, 8)], clip_grad=1.0, scaler=scaler)
    assert result.skipped and scaler.scale == 0.5e39
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q), "a skipped step must not touch the parameters"
    result = _step(model, opt, [_batch(2, 1, 8)], clip_grad=1.0, scaler=DynamicLossScaler(2.0**10))
    assert not result.skipped and math.isfinite(result.grad_norm)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_scaler_grows_after_clean_steps():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=3)
    for _ in range(3):
        s.update(True)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 4.0 and s.clean_steps == 0


@pytest.mark.parametrize("kwargs, named", [
    (dict(growth_interval=0), "growth_interval"), (dict(growth_interval=2.5), "growth_interval"),
    (dict(backoff=1.0), "backoff"), (dict(backoff=0.0), "backoff"), (dict(growth=1.0), "growth"),
    (dict(init_scale=float("inf")), "init_scale"), (dict(init_scale=0.0), "init_scale"),
    (dict(min_scale=0.0), "min_scale"), (dict(init_scale=2.0, min_scale=4.0), "min_scale")])
def test_scaler_settings_that_cannot_work_are_refused_by_name(kwargs, named):
    # growth_interval=0 divided by zero at the first clean step; backoff >= 1 never lowered the scale
    with pytest.raises(ValueError, match=f"DynamicLossScaler: {named} "):
        DynamicLossScaler(**kwargs)


def test_learning_rate_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup=4)
    assert [learning_rate(s, cfg, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    mid = 4 + (20 - 4) // 2
    assert learning_rate(mid, cfg, 20) == pytest.approx(0.1 + 0.5 * 0.9 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(20, cfg, 20) == 0.1 and learning_rate(100, cfg, 20) == 0.1
    values = [learning_rate(s, cfg, 20) for s in range(4, 20)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_optimizer_groups_survive_loading_its_state():
    """The LR schedule writes ``optimizer.param_groups``: after ``load_state_dict`` (which
    replaces AdamW's group dicts) a new learning rate must still reach the update."""
    model = _model()
    dp, opt = _optimizer(model)
    _step(model, (dp, opt), [_batch(2, 0, 8)], clip_grad=1.0)
    opt.load_state_dict(opt.state_dict())
    for group in opt.param_groups:
        group["lr"] = 0.0  # nothing may move
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, (dp, opt), [_batch(2, 1, 8)], clip_grad=1.0)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} moved at lr 0 after load_state_dict"


def test_gradient_norm_of_16_bit_gradients_is_taken_in_fp32():
    """Gradients of a 16-bit model without tessera's buffers (distributed.finalize.param_grads):
    the norm of finite fp16 gradients is finite (an fp16 norm overflowed past 65504 to inf, and
    clipping then zeroed every gradient), and a bf16 norm is the fp32 norm of those values."""
    from tessera.optim import clip_coefficient, global_grad_norm

    p = torch.nn.Parameter(torch.zeros(100_000))
    big = torch.full((100_000,), 300.0, dtype=torch.float16)  # norm ~94,868
    norm = global_grad_norm([(big, p)], Topology.build())
    assert norm.dtype == torch.float32 and torch.isfinite(norm)
    assert norm.item() == pytest.approx(300.0 * math.sqrt(100_000), rel=1e-4)  # (fp32 summation)
    assert clip_coefficient(norm, 1.0).item() > 0
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert global_grad_norm([(g, p)], Topology.build()).item() == pytest.approx(g.float().norm().item(), rel=1e-5)


@pytest.mark.parametrize("max_norm", [-1.0, float("nan")])
def test_clipping_to_a_negative_or_nan_norm_is_refused(max_norm):
    """A negative max_norm turned clipping off silently; NaN made every gradient NaN."""
    from tessera.optim import clip_coefficient

    with pytest.raises(ValueError, match=f"max_norm is the gradient norm to clip to, >= 0.*not {max_norm}"):
        clip_coefficient(torch.tensor(2.0), max_norm)
    assert clip_coefficient(torch.tensor(2.0), 0.0) is None
    assert clip_coefficient(torch.tensor(2.0), 1.0).item() == pytest.approx(0.5, rel=1e-5)


def test_sequence_parallel_sums_of_16_bit_gradients_run_in_fp32(monkeypatch):
    """Four ranks' bf16 gradients 1, 2^-8, 2^-8, 2^-8: summed pairwise in bf16 each 1 + 2^-8 rounds
    back to 1; summed in fp32 and rounded once they give 1 + 2^-6 (the tie goes to even)."""
    import tessera.distributed.finalize as finalize

    seen = []

    def all_reduce(flat, group):  # stands in for the three other ranks of a tp=4 group
        seen.append(flat.dtype)
        for _ in range(3):
            flat.add_(torch.tensor(2.0 ** -8, dtype=flat.dtype))

    monkeypatch.setattr(finalize.dist, "all_reduce", all_reduce)
    g16 = torch.ones(3, dtype=torch.bfloat16)
    g32 = torch.ones(2)
    finalize._all_reduce_coalesced([g16, g32], group=object())
    assert seen == [torch.float32, torch.float32]
    assert g16.tolist() == [1 + 2.0 ** -6] * 3 and g32.tolist() == [1 + 3 * 2.0 ** -8] * 2


def test_a_global_batch_without_loss_tokens_gives_loss_zero_not_nan():
    """Every target masked (e.g. all end-of-document under data.eod_mask_loss): 0/0 made the loss
    and, through the update, every weight NaN for good."""
    cfg = ModelConfig(hidden=32, heads=4, layers=2, seq_len=8, vocab_size=40)
    model = GPTModel(cfg)
    model.init_weights(3)
    topo = Topology.build(device="cpu")
    dp = DataParallel([model], topo, zero=0)
    optimizer = MainParamOptimizer(dp, OptimConfig(lr=1e-2))
    tokens = torch.randint(0, 40, (2, 8))
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.zeros(2, 8)}
    executor = PipelineExecutor([model], build_schedule("none", 1, 1, 1, 0), None, 1, 0)
    result = train_step(optimizer, [batch], topo, executor, dp, clip_grad=1.0)
    assert result.loss == 0.0 and result.grad_norm == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
