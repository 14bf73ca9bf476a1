"""train.fused_elementwise: Llama's RMSNorm, RoPE and SwiGLU as compiled functions (models/fused.py).

On a CPU the layers take the reference ops; here the functions are also compiled whole
(inductor's CPU backend, fullgraph: no graph break) and checked against the reference, and the
flag is followed from the config down to every module that uses it. The CUDA kernels are
compared in tests/test_gpu.py."""

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ModelConfig, load_config
from tessera.models import GPTModel, TPContext
from tessera.models import fused
from tessera.models.transformer import MLP, RMSNorm, RotaryEmbedding
from tessera.training.plan import make_plan
from tessera.training.preflight import validate


def test_reference_functions_are_the_layers_maths():
    torch.manual_seed(0)
    x, w = torch.randn(8, 2, 16), torch.randn(16)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (16,), w, 1e-5))
    ref = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(w)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), ref(x))
    y = torch.randn(8, 2, 12)
    torch.testing.assert_close(fused.swiglu(y), F.silu(y[..., :6]) * y[..., 6:])
    q, cos, sin = torch.randn(2, 4, 8, 6), torch.randn(8, 6), torch.randn(8, 6)
    rotated = torch.cat([-q[..., 3:], q[..., :3]], dim=-1)
    torch.testing.assert_close(fused.rope(q, q, cos, sin)[1], q * cos + rotated * sin)


@pytest.mark.slow
def test_functions_compile_whole_and_match_the_reference():
    torch.manual_seed(0)
    x, w, y = torch.randn(8, 2, 16), torch.randn(16), torch.randn(8, 2, 24)
    q, k = torch.randn(8, 2, 4, 6).permute(1, 2, 0, 3), torch.randn(8, 2, 2, 6).permute(1, 2, 0, 3)
    cos, sin = torch.randn(8, 6), torch.randn(8, 6)
    cases = [(fused.rms_norm, (x, w), (1e-5,)), (fused.rope, (q, k), (cos, sin)), (fused.swiglu, (y,), ())]
    for fn, inputs, consts in cases:
        results = []
        for f in (torch.compile(fn, fullgraph=True, dynamic=False), fn):
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = f(*leaves, *consts)
            out = out if isinstance(out, tuple) else (out,)
            sum((o * (i + 1)).sum() for i, o in enumerate(out)).backward()
            results.append([o.detach() for o in out] + [t.grad for t in leaves])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cpu_tensors_and_compiling_layers_take_the_reference_ops(monkeypatch):
    x = torch.zeros(2)
    assert fused.kernels(True, x).rms_norm is fused.rms_norm  # CPU: never compiled
    assert fused.kernels(False, x).swiglu is fused.swiglu
    if torch.cuda.is_available():
        assert fused.kernels(True, x.cuda()).rope is not fused.rope
    else:  # a CUDA tensor's choice, without a GPU: is_cuda faked
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert fused.kernels(True, x).rope is not fused.rope
        assert fused.kernels(False, x).rope is fused.rope
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # inside a compiled layer
        assert fused.kernels(True, x).rope is fused.rope


def test_fused_layers_run_through_the_compiled_set(monkeypatch):
    """With the flag on and a CUDA tensor (faked here), each llama module calls the compiled
    functions (replaced by recording ones) and computes what the reference computes."""
    calls = []

    def recording(name):
        def run(*args):
            calls.append(name)
            return getattr(fused, name)(*args)
        return run

    stand_in = fused.Kernels(compiled=False)
    for name in ("rms_norm", "rope", "swiglu"):
        setattr(stand_in, name, recording(name))
    monkeypatch.setattr(fused, "_compiled", lambda: stand_in)
    cfg = ModelConfig(family="llama", hidden=32, heads=4, kv_heads=2, layers=1, seq_len=16, vocab_size=64)
    on, off = GPTModel(cfg, TPContext(fused_elementwise=True)), GPTModel(cfg, TPContext())
    on.init_weights(3), off.init_weights(3)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    layer_on, layer_off = on.layers["0"], off.layers["0"]
    expected = layer_off(x)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got = layer_on(x)
    assert sorted(calls) == ["rms_norm", "rms_norm", "rope", "swiglu"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    calls.clear()
    layer_off(x)  # the flag off: never the compiled set, CUDA or not
    assert calls == []


@pytest.mark.parametrize("on", [False, True])
def test_the_config_flag_reaches_every_llama_module(on):
    cfg = load_config(None, ["model.family=llama", f"train.fused_elementwise={str(on).lower()}", "parallel.pp=2"])
    assert cfg.train.fused_elementwise is on
    model_cfg = ModelConfig(family="llama", hidden=32, heads=4, kv_heads=2, layers=2, seq_len=16, vocab_size=64)
    # as the plan resolves it for eager layers on CUDA (zb-h1 at pp=2: eager layers)
    resolved = make_plan(validate(cfg, 2), torch.device("cuda")).fused_elementwise
    assert resolved is on
    model = GPTModel(model_cfg, TPContext(fused_elementwise=resolved))
    users = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, MLP))]
    assert len(users) == 2 * 4 + 1  # per layer two norms, the rotary tables and the MLP; the final norm
    assert all(m.fused is on for m in users)
    # the same losses either way on a CPU (the reference ops run in both)
    other = GPTModel(model_cfg, TPContext(fused_elementwise=not on))
    model.init_weights(1), other.init_weights(1)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens, tokens), other(tokens, tokens), rtol=0, atol=0)


def test_auto_compiles_the_elementwise_functions_in_llamas_uncompiled_cuda_layers():
    """train.fused_elementwise as the plan resolves it: auto (and true) in llama's eager or
    graphed CUDA layers (BENCHMARKS.md, Pipeline parallelism and Tensor parallelism), never on a
    CPU, inside compiled layers, or for gpt2."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def resolved(sets, compiled=False, device=cuda):
        cfg = load_config(None, sets + (["train.compile=true"] if compiled else ["train.compile=false"]))
        return make_plan(validate(cfg, 1), device).fused_elementwise

    llama = ["model.family=llama"]
    assert resolved(llama) is True
    assert resolved(llama + ["train.fused_elementwise=true"]) is True
    assert resolved(llama, device=cpu) is False
    assert resolved(llama, compiled=True) is False
    assert resolved(llama + ["train.fused_elementwise=true"], compiled=True) is False
    assert resolved(llama + ["train.fused_elementwise=false"]) is False
    assert resolved([]) is False  # gpt2: LayerNorm and GELU are one kernel each already
