"""GPU paths on one GPU (skipped without CUDA; run on the GPU machine): SDPA's CUDA kernels, the
fast paths against their references, bf16; the paths of two GPUs and more are in test_gpu_nccl.py."""

import contextlib
import re
import sys

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models import GPTModel
from gpu_runs import run_killable, train_run

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_elementwise_functions_match_the_reference(dtype):
    """RMSNorm, RoPE and SwiGLU compiled on CUDA (models/fused.py) against the same functions
    eager: values and input gradients, at Llama-1B's shapes for one micro-batch."""
    from tessera.models.fused import kernels

    fused, ref = kernels(True, torch.zeros(1, device="cuda")), kernels(False, torch.zeros(1))
    assert fused is not ref
    gen = torch.Generator("cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    x, w, y = rand(2048, 2, 2048), rand(2048), rand(2048, 2, 2 * 4096)
    # [s, b, heads, d] viewed as [b, heads, s, d], as the attention hands them over
    q, k = rand(2048, 2, 16, 64).permute(1, 2, 0, 3), rand(2048, 2, 4, 64).permute(1, 2, 0, 3)
    cos, sin = rand(2048, 64), rand(2048, 64)
    # fp32: RMSNorm's weight gradient sums 4,096 rows in another order (4.6e-5 apart measured)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    cases = [("rms_norm", (x, w), (1e-5,)), ("rope", (q, k), (cos, sin)), ("swiglu", (y,), ())]
    for name, inputs, consts in cases:
        outs = []
        for ks in (fused, ref):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            out = getattr(ks, name)(*leaves, *consts)
            out = out if isinstance(out, tuple) else (out,)
            sum((o.float() * (i + 1)).sum() for i, o in enumerate(out)).backward()
            outs.append([o.detach() for o in out] + [t.grad for t in leaves])
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cuda_model_matches_cpu(family):
    cfg = ModelConfig(family=family, hidden=128, heads=4, kv_heads=2 if family == "llama" else 0,
                      layers=2, seq_len=64, vocab_size=300)
    cpu = GPTModel(cfg)
    cpu.init_weights(7)
    gpu = GPTModel(cfg, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    ref = cpu(tokens, labels=tokens.roll(-1, 1))
    ref.mean().backward()
    out = gpu(tokens.cuda(), labels=tokens.roll(-1, 1).cuda())
    out.mean().backward()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-3, atol=1e-5, msg=name)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = gpu(tokens.cuda(), labels=tokens.roll(-1, 1).cuda())
    assert (bf16.mean() - ref.mean()).abs().item() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_step_result_is_read_without_waiting_for_later_work():
    """A step's figures are copied to the host behind its own work: reading them returns while
    work queued after the step (the next step, here a second of spinning) still runs."""
    from tessera.training.step import StepResult

    x = torch.ones((), device="cuda")
    loss, norm, tokens = x * 2, x * 3, x * 4
    # a first launch, as training's first step: it allocates the pinned block (cudaHostAlloc) and
    # loads its kernels (lazily loaded CUDA modules), either of which may synchronise the device;
    # later steps reuse freed blocks from torch's caching host allocator
    assert StepResult.launch(loss, norm, tokens, skipped=False).loss == 2.0
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU cycles: the step's own work, still running
    result = StepResult.launch(loss, norm, tokens, skipped=False)
    launched_early = not torch.cuda.current_stream().query()  # launch did not wait for the step
    torch.cuda._sleep(2_000_000_000)  # ~1 s more, queued after the copy: the next step
    assert (result.loss, result.grad_norm, result.tokens) == (2.0, 3.0, 4)
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert launched_early, "StepResult.launch waited for the step's work"
    assert still_running, "reading the step waited for the work launched after it"
    # the step's time is where its work ran: between CUDA events, not the host's launch times
    from tessera.training.step import StepClock
    clock = StepClock(torch.device("cuda"))
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU work in "the step"
    elapsed = clock.lap(StepResult.launch(x, x, x, skipped=False))
    assert 0.05 < elapsed < 5, elapsed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_adamw_applies_the_clip_factor_like_foreach():
    """On CUDA the clipping factor goes into the fused AdamW kernel (grad_scale); on CPU it
    multiplies the gradients first. Both must give the same update."""
    from tessera.config import OptimConfig
    from tessera.distributed.data_parallel import DataParallel
    from tessera.optim.optimizers import MainParamOptimizer
    from tessera.topology import Topology

    results = []
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64).to(device)
        dp = DataParallel([model], Topology.build(device=device))
        opt = MainParamOptimizer(dp, OptimConfig(lr=1e-2))
        for _ in range(3):
            dp.start_step(1)
            model(torch.ones(2, 64, device=device)).square().sum().backward()
            dp.finish_grad_sync()
            opt.grads()
            opt.step(torch.tensor(0.25, device=device))
            opt.zero_grad()
        results.append(model.weight.detach().cpu())
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_staged_through_pinned_buffers_equals_whole_ranges():
    """parallel.offload_staging on CUDA: spans copied down through two pinned buffers (each copy
    awaited by its CUDA event while the CPU updates the span before) give the bits of one span
    per range."""
    from tessera.config import OptimConfig
    from tessera.distributed.data_parallel import DataParallel
    from tessera.optim.optimizers import MainParamOptimizer
    from tessera.topology import Topology

    results = []
    for staging in (0, 3000):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to("cuda", torch.bfloat16)
        dp = DataParallel([model], Topology.build(device="cuda"), param_dtype=torch.bfloat16, bucket_size=10000)
        opt = MainParamOptimizer(dp, OptimConfig(lr=1e-2), offload=True, offload_staging=staging)
        assert len(opt.staging) == 2 and all(b.is_pinned() for b in opt.staging)
        for _ in range(3):
            dp.start_step(1)
            model(torch.ones(2, 64, device="cuda", dtype=torch.bfloat16)).float().square().sum().backward()
            dp.finish_grad_sync()
            opt.grads()
            opt.step(torch.tensor(0.5, device="cuda"))
            opt.zero_grad()
        torch.cuda.synchronize()
        results.append((len(opt.spans), [p.detach().cpu() for p in model.parameters()]))
    (whole, expected), (parts, got) = results
    assert parts > whole == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_varlen_attention_matches_the_mask_path():
    """Packed sequences on CUDA run variable-length (flash) attention; it must equal SDPA with the
    block-diagonal causal mask, the CPU path."""
    from tessera.models import packed

    if packed.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    doc = torch.tensor([[0] * 10 + [1] * 30 + [2] * 24, [0] * 64], device="cuda")
    seq = packed.PackedSequence(document_ids=doc)
    fast = seq.attention(q, k, v, 0.0, enable_gqa=False)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seq.mask())
    torch.testing.assert_close(fast, reference, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_cross_entropy_matches_the_reference():
    """The compiled vocab-parallel loss on bf16 logits with a padded vocabulary (GPT-1.3B's
    shape per micro-batch) equals the reference ops: loss and 16-bit logits gradient."""
    from tessera.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(1024, 2, 50304, device="cuda", generator=g) * 4).to(torch.bfloat16)
    logits[..., 50257:] = 100.0  # padding: must get no probability
    target = torch.randint(0, 50257, (1024, 2), device="cuda", generator=g)
    weight = torch.rand(1024, 2, device="cuda", generator=g)
    out = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, None, 50257, fused=fused)
        (loss * weight).sum().backward()
        out.append((loss, x.grad))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-5)
    assert out[1][1].dtype == torch.bfloat16
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-2, atol=1e-5)
    assert out[1][1][..., 50257:].abs().max().item() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_weight_gradient_accumulation_is_exact_to_fp32():
    """Gradient-accumulation fusion on CUDA: bf16 GEMMs written (mm, the step's first product)
    and accumulated (addmm) into an fp32 main gradient by cuBLAS, where this torch has those
    GEMMs. The result must be closer to the fp64 sum than the reference (bf16 product rounded,
    then added), and exact to fp32 where both GEMMs exist."""
    from tessera.tensor_parallel.wgrad import fused_supported, wgrad_into

    g = torch.Generator(device="cuda").manual_seed(0)
    pairs = [(torch.randn(1024, 4096, device="cuda", generator=g).to(torch.bfloat16),
              torch.randn(4096, 512, device="cuda", generator=g).to(torch.bfloat16)) for _ in range(4)]
    out = torch.empty(1024, 512, device="cuda")
    first, added = fused_supported(out, pairs[0][0], False), fused_supported(out, pairs[0][0], True)
    if not (first or added):
        pytest.skip(f"torch {torch.__version__} has neither mm nor addmm with an fp32 out_dtype for bf16 inputs")
    exact = sum(a.double() @ b.double() for a, b in pairs)
    errors = []
    for fused in (None, False):  # None: what wgrad_into chooses here
        acc = torch.full_like(out, float("nan"))  # a step's first product must overwrite, not add
        for i, (a, b) in enumerate(pairs):
            wgrad_into(acc, a, b, accumulate=i > 0, fused=fused)
        errors.append((acc.double() - exact).abs())
    mean = [e.mean().item() for e in errors]
    assert mean[0] < mean[1], f"mean error fused {mean[0]} vs reference {mean[1]} (mm {first}, addmm {added})"
    if first and added:
        assert errors[0].max().item() < 1e-5 * exact.abs().max().item(), mean


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graphed_layers_add_their_gradients_on_the_steps_stream(monkeypatch):
    """Layers captured and trained inside cuda_graphs.step_stream, as the trainer does: the
    AccumulateGrad nodes the capture makes (kept by the graphs) live on the step's stream, so
    every gradient, graphed layers' included, reaches DataParallel on the step's stream, where
    its bucket's reduction is launched from, with no handover; and the gradients equal the eager
    layers'. Captured on torch's own capture stream instead, the graphed layers' gradients
    arrive on that one and DataParallel hands each over to the step's stream (the same sums)."""
    from tessera.distributed.data_parallel import DataParallel
    from tessera.topology import Topology
    from tessera.training.cuda_graphs import graph_layers, step_stream

    cfg = ModelConfig(family="gpt2", hidden=128, heads=4, layers=2, seq_len=64, vocab_size=300)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device="cuda")

    def run(own_stream: bool):
        model = GPTModel(cfg, device="cuda")
        model.init_weights(3)
        dp = DataParallel([model], Topology.build(device="cuda"), bucket_size=10**6)
        streams, add, switches, set_stream = [], dp.accumulate, [], torch.cuda.set_stream
        dp.accumulate = lambda p, g: (streams.append(torch.cuda.current_stream()), add(p, g))
        monkeypatch.setattr(torch.cuda, "set_stream", lambda s: (switches.append(s), set_stream(s)))

        def step():
            dp.start_step(1)
            model(tokens, labels=tokens.roll(-1, 1)).mean().backward()
            dp.finish_grad_sync()
            return [p.main_grad.clone() for p in model.parameters()]

        with step_stream(torch.device("cuda")) if own_stream else contextlib.nullcontext():
            eager = step()
            graphs = graph_layers(model, micro_batch=2, sequence_length=cfg.seq_len, data_parallel=dp)
            try:
                streams.clear()
                switches.clear()
                graphed = [step(), step()]
                handovers = len(switches)
            finally:
                graphs.release()
            here = torch.cuda.current_stream()
        return eager, graphed, streams, here, handovers

    n = sum(1 for _ in GPTModel(cfg).parameters())
    graphed_params = sum(1 for _ in GPTModel(cfg).layers.parameters())
    for own_stream in (True, False):
        eager, graphed, streams, here, handovers = run(own_stream)
        assert len(streams) == 2 * n and set(streams) == {here}, set(streams)
        # a handover switches to the step's stream and back, per graphed gradient
        assert handovers == (0 if own_stream else 2 * 2 * graphed_params), (own_stream, handovers)
        for grads in graphed:
            for a, b in zip(grads, eager):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# train.fused_elementwise is auto (on in llama's eager and graphed CUDA layers): runs without it say false
_NO_EW = "train.fused_elementwise=false"
# the fast paths, in groups that each fit one GPU call (~40 s a run): name -> overrides
_FAST_PATH_GROUPS = {
    # what auto picks for llama at tp=1 (compiled layers with fused weight
    # gradients, one graph per layer around tessera::deferrable_linear; fused cross entropy), and
    # compiled layers without the fusion (auto's pick before)
    "compiled": {"fast": [], "unfused": ["train.grad_accum_fusion=false", "train.compile=true"]},
    # eager layers: fused weight gradients (what auto picks for GPT), and with them the compiled
    # RMSNorm, RoPE and SwiGLU (what auto picks for llama's split-backward pipelines)
    "eager": {"fused": ["train.grad_accum_fusion=true", "train.compile=false", _NO_EW],
              "elementwise": ["train.grad_accum_fusion=true", "train.compile=false"]},
    # CUDA-graphed layers (auto at tp > 1; forced here on one GPU): plain, with the fused
    # fp32-accumulating weight-gradient GEMMs captured, and with the compiled elementwise
    # functions captured (what auto picks for llama at tp > 1)
    "graphed": {"graphed": ["train.cuda_graphs=true", "train.compile=false", "train.grad_accum_fusion=false", _NO_EW],
                "graphed-fused": ["train.cuda_graphs=true", "train.compile=false", "train.grad_accum_fusion=true",
                                  _NO_EW],
                "graphed-elementwise": ["train.cuda_graphs=true", "train.compile=false",
                                        "train.grad_accum_fusion=false"]},
}


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("group", list(_FAST_PATH_GROUPS))
def test_fast_paths_follow_the_reference_loss_curve(tmp_path, group):
    """200 bf16 steps of a small llama follow the all-off curve (eager layers, reference cross
    entropy and elementwise ops, autograd weight gradients) within bf16 tolerance with each
    combination of fast paths in the group."""
    model = ["model.hidden=256", "model.layers=4", "model.heads=4", "model.seq_len=256", "model.vocab_size=1000",
             "train.dtype=bf16", "train.steps=200", "train.log_every=50", "optim.lr=1e-3", "data.source=builtin",
             "model.family=llama", "model.kv_heads=2", "model.ffn_hidden=704"]
    ref = train_run(tmp_path, "ref", 1, model + ["train.fused_cross_entropy=false", "train.grad_accum_fusion=false",
                                              "train.compile=false", _NO_EW])
    assert "RMSNorm / RoPE / SwiGLU compiled" not in (tmp_path / "ref" / "output.log").read_text()
    runs = {name: train_run(tmp_path, name, 1, model + sets) for name, sets in _FAST_PATH_GROUPS[group].items()}
    for name in ("elementwise", "graphed-elementwise"):
        if name in runs:  # auto's choice made visible in the first log line
            assert "RMSNorm / RoPE / SwiGLU compiled" in (tmp_path / name / "output.log").read_text(), name
    assert len(ref) == 200 and all(len(run) == 200 for run in runs.values())
    assert ref[-1]["loss"] < 0.6 * ref[0]["loss"], "the run must learn"
    for name, run in runs.items():
        for w in range(0, 200, 10):  # windows of 10 steps: bf16 noise per step, the same curve
            a, b = (sum(m["loss"] for m in r[w:w + 10]) / 10 for r in (run, ref))
            assert a == pytest.approx(b, rel=3e-2), f"{name}: steps {w + 1}-{w + 10}"


@pytest.mark.timeout(400)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpointed_run_resumes_on_cuda(tmp_path, family):
    """bf16 with the default fast paths (fused AdamW, its step count on the GPU; fused weight
    gradients; llama's compiled layers, fused cross entropy): a run resumed from its step-4
    checkpoint continues as the run that went on (the same kernels on the same numbers; bitwise
    where the kernels are deterministic)."""
    base = [f"model.family={family}", "train.dtype=bf16", "train.steps=8", "optim.decay_steps=8", "train.log_every=1"]
    straight = train_run(tmp_path, "straight", 1, base + ["checkpoint.save_every=4", f"checkpoint.dir={tmp_path}/ck"])
    resumed = train_run(tmp_path, "resumed", 1, base + [f"checkpoint.load={tmp_path}/ck/step_00000004"])
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    for a, b in zip(straight[4:], resumed):
        assert (b["loss"], b["grad_norm"]) == pytest.approx((a["loss"], a["grad_norm"]), rel=1e-5), a["step"]
    print("bitwise:", [(a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]) for a, b in zip(straight[4:], resumed)])


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_validation_loss_of_compiled_layers_follows_eager_layers(tmp_path):
    """Llama at tp=1 (compiled layers with fused weight gradients by default, bf16): the
    validation loss (eval mode: a recompile for it, no backward) follows eager layers'."""
    base = ["model.family=llama", "train.dtype=bf16", "train.eval_every=4", "train.eval_batches=2"]
    compiled = train_run(tmp_path, "compiled", 1, base)
    eager = train_run(tmp_path, "eager", 1, base + ["train.compile=false", "train.grad_accum_fusion=false"])
    got, want = ([m["valid_loss"] for m in run if "valid_loss" in m] for run in (compiled, eager))
    assert len(got) == len(want) == 2
    assert got == pytest.approx(want, rel=2e-2)


@pytest.mark.timeout(500)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layout", ["llama-zero0-1", "gpt2-zero0-1", "gpt2-zero3-2"])
def test_a_nonfinite_step_changes_nothing_on_cuda(tmp_path, layout):
    """bf16 on CUDA: a nan injected at step 3 (train.nonfinite=skip) reaches the fused AdamW kernel
    as its found_inf: step 3's checkpoint holds step 2's weights and moments exactly, and training
    goes on; under stop, the re-run on the same weights tells the transient fault apart."""
    from tessera.checkpoint import dcp

    family, zero, gpus = layout.replace("-zero", "-").split("-")
    if torch.cuda.device_count() < int(gpus):
        pytest.skip(f"needs {gpus} GPUs")
    base = [f"model.family={family}", f"parallel.zero={zero}", f"parallel.dp={gpus}", "train.dtype=bf16", "train.steps=5",
            "train.log_every=1", "train.inject_fault_step=3"]
    run = train_run(tmp_path, "skip", int(gpus), base + ["train.nonfinite=skip", "checkpoint.save_every=1",
                                              f"checkpoint.dir={tmp_path}/ck"])
    assert [m["skipped"] for m in run] == [False, False, True, False, False]
    two, three, four = (dcp.read_whole(f"{tmp_path}/ck/step_0000000{i}", "") for i in (2, 3, 4))
    assert all(torch.equal(two[k], three[k]) for k in two) and not all(torch.equal(three[k], four[k]) for k in three)
    sets = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.seq_len=64", "train.micro_batch=2",
            "train.global_batch=8", "data.source=synthetic", f"train.out_dir={tmp_path}/stop", *base,
            "train.inject_fault=nan_once"]
    launch = ["--nproc-per-node", gpus] if gpus != "1" else []  # (torchrun's own exit status is 1)
    returncode, out = run_killable([sys.executable, "-m", "tessera", "train", *launch,
                            *[a for s in sets for a in ("--set", s)]], "stop", 300)
    assert returncode == (3 if gpus == "1" else 1) and "so it is not reproducible" in out, out[-3000:]
    first, again = re.findall(r"loss ([-\w.+]+)", out.split("tessera: step 3: gradient norm")[1])[:2]
    assert first == again, out[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gradient_spike_is_passed_over_on_cuda(tmp_path):
    """train.skip_spikes on CUDA (the window on the device, bf16): step 6's gradient times 1e4 is
    passed over, the other steps are applied."""
    run = train_run(tmp_path, "spike", 1, ["train.dtype=bf16", "train.skip_spikes=6", "train.spike_window=4",
                                        "train.inject_fault=spike", "train.inject_fault_step=6", "train.log_every=1"])
    assert [m["skipped"] for m in run] == [False] * 5 + [True, False, False]


@pytest.mark.timeout(400)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_layers_follow_the_plain_run_on_cuda(tmp_path, family, mode):
    """train.recompute=full or selective in bf16 on CUDA (llama: the compiled elementwise functions
    inside the recomputed eager layers; selective keeps the flash kernel's outputs): the same curve
    as without (the forward reruns the same kernels; attention's backward is not bitwise
    deterministic)."""
    base = [f"model.family={family}", "train.dtype=bf16", "train.log_every=1", "train.compile=false"]
    plain = train_run(tmp_path, "plain", 1, base)
    again = train_run(tmp_path, "again", 1, base + [f"train.recompute={mode}"])
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in plain], rel=1e-2)
    assert again[-1]["loss"] < again[0]["loss"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_graphed_decode_step_generates_what_the_eager_step_generates(dtype):
    """generate(cuda_graph=True): each decode step one replay (inference/decode_graph.py), greedy
    and drawn, prompts of different lengths, past seq_len. The graph attends over every slot
    (masked), the eager step over the filled ones: fp32 gives the same tokens; bf16, whose
    rounding differs between the two shapes, the same first tokens."""
    from tessera.inference.generate import generate
    from tessera.inference.sampling import Sampling
    from tessera.topology import Topology

    cfg = ModelConfig(family="llama", hidden=128, heads=4, kv_heads=2, layers=2, seq_len=32, vocab_size=300,
                      tie_embeddings=False, init_std=0.3)  # (spread logits: no near-ties)
    model = GPTModel(cfg, device="cuda")
    model.init_weights(7)
    model.to(dtype)
    topo = Topology.build(device="cuda")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=40, seed=1)):
        eager = generate([model], prompts, 40, topo=topo, sampling=sampling)
        graphed = generate([model], prompts, 40, topo=topo, sampling=sampling, cuda_graph=True)
        if dtype == torch.float32:
            assert graphed == eager
        else:
            assert [ids[: len(p) + 4] for p, ids in zip(prompts, graphed)] == \
                [ids[: len(p) + 4] for p, ids in zip(prompts, eager)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_embeddings_fused_rows_are_deterministic_and_exact_on_cuda():
    """Gradient-accumulation fusion of a bf16 embedding on CUDA: 8,192 lookups of 64 rows (many
    repeats) over two micro-batches add into the fp32 main gradient the float64 sum of the rows to
    fp32 rounding, and two runs give the same bits (a sorted scatter-add, no atomics' order)."""
    from tessera.distributed.data_parallel import DataParallel
    from tessera.tensor_parallel.layers import VocabParallelEmbedding
    from tessera.tensor_parallel.wgrad import WeightGradStore
    from tessera.topology import Topology

    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = [torch.randint(0, 64, (4, 2048), device="cuda", generator=gen) for _ in range(2)]
    grads = [torch.randn(4, 2048, 256, device="cuda", generator=gen).bfloat16() for _ in range(2)]
    want = torch.zeros(1000, 256, dtype=torch.float64, device="cuda")
    for i, g in zip(ids, grads):
        want.index_add_(0, i.reshape(-1), g.reshape(-1, 256).double())
    runs = []
    for _ in range(2):
        emb = VocabParallelEmbedding(1000, 256, tp_group=None, device="cuda", dtype=torch.bfloat16)
        dp = DataParallel([emb], Topology.build(device="cuda"), param_dtype=torch.bfloat16)
        emb.wgrad_store = WeightGradStore(sink=dp, fuse=True)
        dp.start_step(2)
        for i, g in zip(ids, grads):
            emb(i).backward(g)
        dp.finish_grad_sync()
        runs.append(emb.weight.main_grad.view(1000, 256).clone())
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0].double(), want, rtol=1e-5, atol=1e-4)
