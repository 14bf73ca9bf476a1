"""FP8 training (``train.fp8``, precision/fp8.py): the fp8 linear layer against a reference
quantize-dequantize implementation, forward and gradients, tensorwise and rowwise; the scales
taken over whole tensors, so fp8 at tp=2 + SP, pp=2 and dp=2 (zero 1 and 3) trains as fp8 at
tp=1 does; what fp8 cannot run refused in words."""

from __future__ import annotations

import pytest
import torch

from parity import assert_same_curve
from tessera.config import ConfigError, load_config
from tessera.precision.fp8 import E4M3, E5M2, Float8Recipe, quantize
from tessera.tensor_parallel.fp8_linear import fp8_linear
from tessera.training.preflight import validate
from training_runs import shared_result, train_histories

RESULTS: dict = {}


def _qdq(t: torch.Tensor, dtype, dims) -> torch.Tensor:
    """Reference: ``t`` rounded to ``dtype`` under the scale max / amax over ``dims``, back in fp32."""
    amax = t.abs().amax(dim=dims, keepdim=True).clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale


def _reference(x, w, b, grad, scaling):
    """y, dx, dw, db as the fp8 recipe defines them, in fp32 maths on quantize-dequantized operands."""
    rows = scaling == "rowwise"
    y = _qdq(x, E4M3, (1,) if rows else (0, 1)) @ _qdq(w, E4M3, (1,) if rows else (0, 1)).t() + b
    dx = _qdq(grad, E5M2, (1,) if rows else (0, 1)) @ _qdq(w, E4M3, (0,) if rows else (0, 1))
    dw = _qdq(grad.t(), E5M2, (1,) if rows else (0, 1)) @ _qdq(x, E4M3, (0,) if rows else (0, 1))
    return y, dx, dw, grad.sum(0)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_fp8_linear_equals_quantize_dequantize(scaling):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(24, 32, generator=g) * torch.linspace(0.1, 4, 32)).requires_grad_()
    w = (torch.randn(16, 32, generator=g) * 0.3).requires_grad_()
    b = torch.randn(16, generator=g).requires_grad_()
    grad = torch.randn(24, 16, generator=g) * 1e-3
    y = fp8_linear(x, w, b, Float8Recipe(scaling))
    y.backward(grad)
    ry, rdx, rdw, rdb = _reference(x.detach(), w.detach(), b.detach(), grad, scaling)
    for got, want, what in ((y, ry, "y"), (x.grad, rdx, "dx"), (w.grad, rdw, "dw"), (b.grad, rdb, "db")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{scaling} {what}: {m}")
    # fp8, not the full precision: e4m3 keeps 3 mantissa bits
    exact = x.detach() @ w.detach().t() + b.detach()
    assert 1e-3 < (y - exact).norm() / exact.norm() < 0.1


def test_quantize_rounds_to_the_format_and_keeps_zero():
    t = torch.tensor([[0.0, 1.0, -3.0, 448.0 * 2]])
    q, inv = quantize(t, E4M3, (0, 1), False, None)
    assert q.dtype == E4M3 and q.float().abs().max() == 448.0  # the amax maps to the format's largest
    torch.testing.assert_close(q.float() * inv, t, rtol=0.07, atol=0)
    zero, inv = quantize(torch.zeros(2, 3), E5M2, (0, 1), False, None)
    assert torch.equal(zero.float(), torch.zeros(2, 3)) and torch.isfinite(inv).all()


BASE = ["model.hidden=32", "model.layers=4", "model.heads=4", "model.seq_len=16", "model.vocab_size=64",
        "train.micro_batch=2", "train.global_batch=8", "train.seed=11", "train.steps=8", "train.log_every=1",
        "data.source=synthetic", "optim.lr=3e-3", "optim.warmup=2", "optim.eps=1e-6"]
# on four ranks (dp fills the rest: tp2-sp and pp2 run at dp=2)
LAYOUTS = {"tp2-sp-dp2": ["parallel.tp=2", "parallel.sequence_parallel=true"], "pp2-dp2": ["parallel.pp=2"],
           "dp4-zero1": ["parallel.zero=1"], "dp4-zero3": ["parallel.zero=3"],
           "tp2-pp2-llama": ["parallel.tp=2", "parallel.pp=2", "model.family=llama", "model.kv_heads=2"]}


def _histories(scaling: str) -> dict:
    fp8 = [f"train.fp8={scaling}"]
    one = train_histories(1, BASE + fp8, [[], ["model.family=llama", "model.kv_heads=2"], ["train.fp8=none"]])
    many = train_histories(4, BASE + fp8, list(LAYOUTS.values()), timeout=600)
    return {"one": one[0], "one-llama": one[1], "bf16-free": one[2], **dict(zip(LAYOUTS, many))}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_trains_the_same_on_every_layout(scaling):
    """The first steps within 1e-5 of tp=1 (every operand quantized alike: the scales are whole
    tensors'); later a difference at fp32's last bit, from another order of a sum (dp's gradient
    reduction, a row-parallel layer's partial sums), moves a value across an fp8 rounding
    boundary now and then (an e4m3 step is 6 % of the value), and Adam carries it on: over 8
    steps the losses stay within 1e-4 and the gradient norms within 1e-2 (measured: 7e-5 and
    4e-3 at most), where the same layouts without fp8 agree to 1e-5 throughout."""
    runs = shared_result(RESULTS, scaling, lambda: _histories(scaling))
    assert [m["loss"] for m in runs["one"]] != [m["loss"] for m in runs["bf16-free"]], "fp8 changes the maths"
    for name in LAYOUTS:
        reference = runs["one-llama"] if "llama" in name else runs["one"]
        assert_same_curve(reference[:2], runs[name][:2], rel=1e-5, what=f"{scaling} {name}, steps 1-2")
        for a, b in zip(reference, runs[name]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (scaling, name, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2), (scaling, name, a["step"])


def _layer_worker(rank: int, world: int) -> dict:
    """Column (with and without SP) and row fp8 layers at tp=``world`` on the same whole input
    and weights as at tp=1: outputs, input and weight gradients, and whether their operands'
    scales were the whole tensor's (the same at every tp)."""
    import torch.distributed as dist

    from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from tessera.tensor_parallel.mappings import gather_from_tp_region

    group = dist.group.WORLD
    out = {}
    for scaling in ("tensorwise", "rowwise"):
        recipe = Float8Recipe(scaling)
        for kind, sp in (("column", False), ("column", True), ("row", False), ("row", True)):
            g = torch.Generator().manual_seed(7)
            x = torch.randn(8, 2, 32, generator=g) * torch.linspace(0.2, 3, 32)  # [s, b, in]
            grad = torch.randn(8, 2, 48, generator=g) * 0.01
            layer = (ColumnParallelLinear(32, 48, tp_group=group, sequence_parallel=sp, fp8=recipe) if kind == "column"
                     else RowParallelLinear(32, 48, tp_group=group, sequence_parallel=sp, fp8=recipe))
            layer.reset_parameters(torch.Generator().manual_seed(3))
            n = world
            if kind == "column":
                local_x = x.chunk(n, 0)[rank] if sp else x
                local_x = local_x.clone().requires_grad_()
                y = gather_from_tp_region(layer(local_x), group)  # [s, b, 48]
                y.backward(grad)
                dx = local_x.grad
            else:
                local_x = x.chunk(n, -1)[rank].clone().requires_grad_()
                y = layer(local_x)
                full_grad = grad.chunk(n, 0)[rank] if sp else grad
                y.backward(full_grad)
                dx = local_x.grad
                if sp:  # the whole output again, to compare
                    parts = [torch.empty_like(y) for _ in range(n)]
                    dist.all_gather(parts, y.detach().contiguous(), group=group)
                    y = torch.cat(parts, 0)
            parts = [torch.empty_like(layer.weight.grad) for _ in range(n)]
            dist.all_gather(parts, layer.weight.grad.contiguous(), group=group)
            dw = torch.cat(parts, 0 if kind == "column" else 1)
            out[scaling, kind, sp] = (y.detach(), dx.detach(), dw)
    return out


@pytest.mark.timeout(120)
def test_fp8_layers_at_tp2_quantize_as_at_tp1():
    """Each operand's scale is its whole tensor's (a shard's amax all-reduced over TP): the
    layers at tp=2, with and without SP, give tp=1's outputs and gradients to fp32 rounding."""
    from tessera.testing import run_ranks

    one = run_ranks(_layer_worker, 1, timeout=60)[0]
    for rank, two in enumerate(run_ranks(_layer_worker, 2, timeout=90)):
        for key, (y, dx, dw) in two.items():
            ry, rdx, rdw = one[key]
            scaling, kind, sp = key
            local_dx = rdx.chunk(2, 0)[rank] if (kind == "column" and sp) else (
                rdx.chunk(2, -1)[rank] if kind == "row" else rdx)
            for got, want, what in ((y, ry, "y"), (dx, local_dx, "dx"), (dw, rdw, "dw")):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} {what}: {m}")


@pytest.mark.parametrize("sets,key,words", [
    (["train.fp8=tensorwise", "train.dtype=fp16"], "train.fp8", "the fp8 GEMMs run inside bf16"),
    (["train.fp8=columnwise"], "train.fp8", "'columnwise' is not one of none, tensorwise, rowwise"),
])
def test_what_fp8_cannot_run_is_refused_in_words(sets, key, words):
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, BASE + sets), 1)
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_fp8_on_a_gpu_without_float8_units_is_refused(monkeypatch):
    from tessera.training import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"train.fp8: tensorwise, but NVIDIA A100 has no float8 matrix units"):
        launch.check_device("auto", "auto", "tensorwise")
    launch.check_device("cpu", "auto", "tensorwise")  # emulated on a CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_fp8_linear_on_cuda_equals_quantize_dequantize(scaling):
    """On CUDA the GEMMs are torch._scaled_mm's float8 kernels, bf16 around them: equal to the
    reference's fp32 maths on the same quantized operands within bf16's rounding of the result."""
    g = torch.Generator("cuda").manual_seed(0)
    x = (torch.randn(256, 512, generator=g, device="cuda") * 2).bfloat16().requires_grad_()
    w = (torch.randn(384, 512, generator=g, device="cuda") * 0.05).bfloat16().requires_grad_()
    grad = (torch.randn(256, 384, generator=g, device="cuda") * 1e-2).bfloat16()
    y = fp8_linear(x, w, None, Float8Recipe(scaling))
    y.backward(grad)
    ry, rdx, rdw, _ = _reference(x.detach().float(), w.detach().float(), 0.0, grad.float(), scaling)
    for got, want, what in ((y, ry, "y"), (x.grad, rdx, "dx"), (w.grad, rdw, "dw")):
        error = (got.float() - want).norm() / want.norm()
        assert error < 1e-2, (scaling, what, error.item())


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_300_steps_of_fp8_end_within_1_5_percent_of_bf16(tmp_path):
    """The demo's model on the demo's text (the builtin corpus), 300 steps in bf16 and in fp8."""
    from training_runs import run_train

    base = ["model.layers=4", "model.hidden=256", "model.heads=4", "model.seq_len=256", "model.vocab_size=256",
            "data.source=builtin", "train.dtype=bf16", "train.steps=300", "train.micro_batch=8",
            "train.global_batch=16", "optim.lr=1e-3", "optim.warmup=20", "train.log_every=50"]
    bf16, _ = run_train(tmp_path / "bf16", 1, base, timeout=500)
    for scaling in ("tensorwise", "rowwise"):
        fp8, _ = run_train(tmp_path / scaling, 1, base + [f"train.fp8={scaling}"], timeout=500)
        last = [sum(m["loss"] for m in run[-20:]) / 20 for run in (bf16, fp8)]
        print(f"bf16 {last[0]:.4f}, fp8 {scaling} {last[1]:.4f}")
        assert abs(last[1] - last[0]) / last[0] < 0.015, (scaling, last)
