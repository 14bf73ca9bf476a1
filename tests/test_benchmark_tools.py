"""The benchmark harness's plumbing (the GPU runs themselves happen on the GPU machine)."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.config import load_config

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare  # noqa: E402
import kernel_table  # noqa: E402
import quick_train  # noqa: E402

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=0", "model.ffn_hidden=0",
        "model.seq_len=32", "model.vocab_size=256", "train.dtype=fp32", "train.global_batch=4"]


def test_the_benchmark_models_load_with_their_known_shapes():
    """benchmarks/models/*.toml through tessera's own loader, with the shapes BENCHMARKS.md reports."""
    assert quick_train.model_names() == ["gpt-1.3b", "llama-1b"]
    gpt = load_config(quick_train.model_config("gpt-1.3b"), [])
    assert (gpt.model.family, gpt.model.layers, gpt.model.hidden, gpt.model.heads, gpt.model.seq_len,
            gpt.model.vocab_size, gpt.model.tie_embeddings) == ("gpt2", 24, 2048, 16, 2048, 50304, True)
    llama = load_config(quick_train.model_config("llama-1b"), ["parallel.tp=2"])
    assert (llama.model.family, llama.model.layers, llama.model.hidden, llama.model.heads, llama.model.kv_heads,
            llama.model.ffn_hidden, llama.model.vocab_size, llama.model.tie_embeddings) == (
        "llama", 16, 2048, 32, 8, 8192, 128256, False)
    assert llama.parallel.tp == 2  # overrides apply on top of the file
    for cfg in (gpt, llama):
        t = cfg.train
        assert (t.micro_batch, t.global_batch, t.dtype, cfg.data.source) == (2, 16, "bf16", "synthetic")
    with pytest.raises(SystemExit, match="gpt-1.3b, llama-1b"):
        quick_train.model_config("gpt-2")


def test_the_peers_run_each_model_with_its_shape_and_batch():
    """compare.PEER_FLAGS says to both peers what the model's TOML says to tessera."""
    assert sorted(compare.PEER_FLAGS) == quick_train.model_names()
    for model, flags in compare.PEER_FLAGS.items():
        cfg = load_config(quick_train.model_config(model), [])
        m, t = cfg.model, cfg.train
        given = dict(zip(flags[::2], flags[1::2]))
        want = {"--layers": m.layers, "--hidden": m.hidden, "--heads": m.heads, "--seq": m.seq_len,
                "--vocab": m.vocab_size, "--mbs": t.micro_batch, "--gbs": t.global_batch}
        if m.family == "llama":
            want |= {"--llama": 1, "--kv-heads": m.kv_heads, "--ffn": m.ffn_hidden}
        assert given == {k: str(v) for k, v in want.items()}, model


def test_quick_train_reports_the_median_after_warmup():
    steps = [{"step": i, "tokens_per_s": tps, "tflops_per_gpu": tps / 100, "loss": 10 - i / 10, "mfu": 0.5,
              "peak_mem_gib": 28.9} for i, tps in enumerate([2000, 50000, 90000, 60000, 62000, 58000, 61000], 1)]
    steps_line, losses, result = quick_train.summary("gpt-1.3b", 2, ["parallel.zero=1"], steps)
    assert steps_line == "STEPS tokens/s per GPU: 1,000 25,000 45,000 30,000 31,000 29,000 30,500"
    assert losses.startswith("LOSSES 9.90000 9.80000")
    assert result == ("RESULT gpt-1.3b nproc=2 parallel.zero=1: 30,250 tokens/s per GPU, 605.0 TFLOP/s per GPU, "
                      "MFU 50.0%, peak memory 28.9 GiB (the logging rank)")
    assert compare.tokens_per_gpu(result) == 30250


@pytest.mark.slow
def test_the_profilers_build_and_step_with_the_public_build_api():
    """bench_setup on one CPU process: the model from its TOML with overrides, the plan, a step."""
    code = (f"import bench_setup; b = bench_setup.setup(['gpt-1.3b', *{TINY!r}]); executor, result = b.step(); "
            "assert b.parts.plan.schedule == 'none' and len(b.parts.chunks) == 1 and b.graphs == []; "
            "print('LOSS', float(result.values[0])); b.close()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=240,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BENCH gpt-1.3b world=1 model.layers=2" in out.stdout and "schedule none" in out.stdout
    assert 5.0 < float(out.stdout.split("LOSS ")[1].split()[0]) < 6.0  # ln(256) = 5.55 at the start


def test_the_profilers_timed_calls_are_put_back():
    """bench_setup.timed_calls wraps an instance's method and a module's function for the steps
    inside, passes over what is absent, and leaves both as they were."""
    import types

    import bench_setup

    class Owner:
        def step(self):
            return 1

    owner, module = Owner(), types.ModuleType("m")
    module.f = original = lambda: 2
    calls = [(owner, "step", "a"), (module, "f", "b"), (owner, "absent", "c"), (None, "step", "d")]
    with bench_setup.timed_calls(calls) as events:
        assert "step" in vars(owner) and module.f is not original
    assert "step" not in vars(owner) and module.f is original and owner.step() == 1 and events == []


def test_reads_both_result_formats():
    assert compare.tokens_per_gpu("x\nRESULT gpt-1.3b nproc=2 parallel.zero=1: 52,041 tokens/s per GPU, 1 TFLOP/s") == 52041
    assert compare.tokens_per_gpu('RESULT {"system": "m", "tokens_per_s_per_gpu": 24651, "x": 1}') == 24651
    assert compare.tokens_per_gpu("no result here") is None


def test_dry_run_lists_tessera_and_both_peers():
    out = subprocess.run([sys.executable, "benchmarks/compare.py", "llama-1b", "1gpu", "tp2", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 6  # 1gpu: tessera, megatron-core, PyTorch; tp2: tessera, megatron-core; tessera 1gpu again
    assert "quick_train.py llama-1b" in out[0] and "mcore_gpt_bench.py" in out[1] and "--llama 1" in out[1]
    assert "parallel.tp=2" in out[3] and "--tp 2" in out[4]


def test_one_gpu_baseline_runs_again_at_the_end_and_its_spread_is_shown():
    out = subprocess.run([sys.executable, "benchmarks/compare.py", "gpt-1.3b", "1gpu", "dp2", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    # tessera's one GPU, first (GPU 0) and last (on the second GPU, which the dp=2 run also paces)
    assert len(out) == 7 and out[0].startswith("NPROC=1 ")
    assert out[-1] == out[0].replace("NPROC=1 ", "NPROC=1 CUDA_VISIBLE_DEVICES=1 ", 1)
    only = subprocess.run([sys.executable, "benchmarks/compare.py", "gpt-1.3b", "1gpu", "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(only) == 3  # nothing to bracket: no second run
    rows = [("1gpu", "tessera", 59000.0), ("1gpu", "megatron-core", 25000.0), ("dp2", "tessera", 56000.0),
            (compare.AGAIN, "tessera", 61000.0)]
    lines = compare.table(rows)
    assert "| dp2 | tessera | 56,000 |  | 0.933 |" in lines  # against the mean, 60,000
    assert "| 1gpu | megatron-core | 25,000 | 2.36 |  |" in lines
    assert lines[-1] == ("tessera one-GPU baseline: 59,000, 61,000 (first run on the first GPU, last on the second), "
                         "mean 60,000, spread 3.3% -- over 2 %: read STEPS for a slow stretch (or one card is slower)")
    steady = compare.table([("1gpu", "tessera", 59000.0), (compare.AGAIN, "tessera", 59500.0)])
    assert steady[-1].endswith("spread 0.8%") and compare.table([("dp2", "tessera", None)])[-1] == "| dp2 | tessera | failed | | |"


def test_the_one_gpu_repeat_runs_on_the_second_gpu_the_two_gpu_runs_use(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert compare.second_gpu() == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5")
    assert compare.second_gpu() == "5"
    assert compare.plan("gpt-1.3b", ["1gpu", "dp2"])[-1][3]["CUDA_VISIBLE_DEVICES"] == "5"


def test_variants_run_tessera_alone_and_compare_with_their_one_gpu_twin():
    runs = compare.plan("gpt-1.3b", ["1gpu", "dp2", "1gpu+train.grad_dtype=bf16", "dp2+train.grad_dtype=bf16"],
                        compare.parse_skip("mcore@1gpu,torch@1gpu"))
    systems = [(layout, system) for layout, system, _, _ in runs]
    assert systems == [("1gpu", "tessera"), ("dp2", "tessera"), ("dp2", "megatron-core"),
                       ("dp2", "PyTorch compiled + DDP"), ("1gpu+train.grad_dtype=bf16", "tessera"),
                       ("dp2+train.grad_dtype=bf16", "tessera"), (compare.AGAIN, "tessera")]
    assert runs[5][2][-2:] == ["parallel.zero=1", "train.grad_dtype=bf16"] and runs[5][3] == {"NPROC": "2"}
    rows = [("1gpu", "tessera", 60000.0), ("dp2", "tessera", 57000.0), ("1gpu+x=1", "tessera", 62000.0),
            ("dp2+x=1", "tessera", 61380.0), ("dp2+y=1", "tessera", 58800.0)]
    lines = compare.table(rows)
    assert "| dp2+x=1 | tessera | 61,380 |  | 0.990 (vs its 1gpu twin, one run) |" in lines  # twin: 62,000
    assert "| dp2+y=1 | tessera | 58,800 |  | 0.980 |" in lines  # no twin: against the plain baseline
    assert "| 1gpu+x=1 | tessera | 62,000 |  | 1.033 |" in lines


def test_bad_layouts_and_skips_are_refused_by_name():
    for bad in (lambda: compare.split_variant("dp3"), lambda: compare.split_variant("dp2+zero"),
                lambda: compare.parse_skip("nemo@1gpu"), lambda: compare.parse_skip("mcore@tp4"),
                lambda: compare.commands("gpt-2", "1gpu")):
        with pytest.raises(SystemExit) as err:
            bad()
        assert any(word in str(err.value) for word in ("dp3", "zero", "nemo", "tp4", "gpt-2"))


def test_skip_takes_both_spellings():
    for spelling in (["--skip", "mcore@1gpu,torch@1gpu"], ["--skip=mcore@1gpu,torch@1gpu"]):
        out = subprocess.run([sys.executable, "benchmarks/compare.py", "gpt-1.3b", "1gpu", *spelling, "--dry-run"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
        assert len(out) == 1 and "quick_train.py" in out[0], spelling  # tessera alone


def test_kernel_table_splits_time_by_what_runs_beside_what(tmp_path):
    """kernel_table.py --read: a timeline of two streams' kernels cut into idle, NCCL alone, compute
    alone, NCCL beside compute and two compute kernels at once (µs in the file, ms out)."""
    rows = ["0,1000,7,ncclDevKernel_AllGather", "500,2000,8,nvjet_gemm", "1500,2500,7,elementwise",
            "3000,4000,7,ncclDevKernel_ReduceScatter"]
    path = tmp_path / "kernels_x_rank0.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n")
    loaded = kernel_table.load(str(path))
    assert kernel_table.totals(loaded, steps=1) == pytest.approx(
        {"nccl alone": 1.5, "nccl beside compute": 0.5, "compute alone": 1.0, "compute x2+": 0.5, "idle": 0.5})
    assert kernel_table.summary(loaded, steps=1) == pytest.approx(
        {"busy": 3.5, "nccl": 2.0, "compute": 2.0, "beside": 0.5})  # (what the profiling run prints)
    first, second = kernel_table.binned(loaded, 2.0)
    assert first == (0.0, pytest.approx({"nccl alone": 0.25, "nccl beside compute": 0.25, "compute alone": 0.25,
                                         "compute x2+": 0.25}))
    assert second == (2.0, pytest.approx({"compute alone": 0.25, "idle": 0.25, "nccl alone": 0.5}))
    out = subprocess.run([sys.executable, "benchmarks/kernel_table.py", "--read", str(path), "--steps", "1"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "nccl beside compute 0.5" in out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_decode_benchmark_prints_its_table_on_a_tiny_model(capsys, tmp_path):
    """benchmarks/decode.py end to end on a CPU (the GPU rows, graphs and the physical limit, are
    the GPU machine's): tessera's and transformers' rows, the same greedy tokens, and the
    profile of a decode step (CPU ops there)."""
    import decode

    decode.main(["llama-1b", "--device", "cpu", "--new-tokens", "4", "--prompt-len", "4", "--batches", "1,2",
                 "--ttft-len", "16", "--profile", str(tmp_path / "prof"),
                 *[a for s in ("model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
                               "model.ffn_hidden=128", "model.vocab_size=512", "model.seq_len=64")
                   for a in ("--set", s)]])
    out = capsys.readouterr().out
    assert "the first 32 of 32 greedy tokens equal tessera's" in out, out
    assert "| | batch 1 tok/s | batch 2 tok/s | TTFT 16 (ms) |".replace("| |", "|  |") in out, out
    assert "| tessera eager |" in out and "| transformers static+compile |" in out, out
    profile = (tmp_path / "prof" / "decode_profile.txt").read_text()
    assert "tessera eager, batch 1, prompt of 4 tokens (a cache of 25 slots), per decode step" in profile, profile
    assert "aten::mm" in profile and "ms per token at batch 1" in profile, profile


@pytest.mark.slow
@pytest.mark.parametrize("flags,count", [([], 10), (["--llama8b", "--no-offload-too"], 2)])
def test_memory_check_runs_its_configurations_on_tiny_shapes(flags, count):
    """benchmarks/memory_check.py --cpu-smoke: every configuration built, stepped and compared,
    one JSON line each, then the table (the GPU numbers come from the GPU machine)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "benchmarks/memory_check.py", "--cpu-smoke", "--steps", "2", *flags],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=400, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == count and not any("error" in r for r in rows), rows
    for row in rows:
        assert row["predicted_gib"] > 0 and row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
        assert (row["predicted_host_gib"] > 0) == ("offload=on" in row["config"] or row["config"].startswith("llama-8b offload"))
    table = out.stdout.split("\n\n")[-1].splitlines()
    assert table[0].startswith("| config | predicted GiB | measured GiB") and len(table) == count + 2


def test_memory_check_runs_all_of_llama8b_where_the_host_has_the_staged_offload():
    """The staged offload's 12 bytes per parameter and two buffers: the Llama-3-8B shape's 32
    layers fit a 125 GiB host (the GPU machine's 128 GiB), where 16 bytes per parameter ran 29."""
    import memory_check

    sets = [*memory_check.LLAMA_8B, "model.seq_len=4096", "train.micro_batch=1", "train.global_batch=2",
            "train.recompute=full", "parallel.optimizer_offload=true"]
    need = memory_check.host_need([*sets, "model.layers=32"])
    assert 12 * 8.03e9 < need < 94 * 2**30
    assert memory_check.layers_that_fit(sets, 32, 125 * 2**30 - memory_check.OTHER_HOST) == 32
    assert memory_check.layers_that_fit(sets, 32, 90 * 2**30 - memory_check.OTHER_HOST) < 32


@pytest.mark.slow
def test_the_fp8_curves_compare_one_config_and_plot_every_run(tmp_path):
    """benchmarks/fp8_curves.py: its runs are one valid config apart only in train.fp8, and the plot
    draws each run's curve from the JSON its GPU half writes."""
    import json

    import fp8_curves
    from tessera.training.preflight import validate

    for extra in fp8_curves.RUNS.values():
        cfg = validate(load_config(None, [*fp8_curves.BASE, *extra]), 1)
        assert cfg.train.fp8 == (extra[0].split("=")[1] if extra else "none")
    data = {"config": fp8_curves.BASE, "curves": {name: [[s, 5.0 - s / 100] for s in range(1, 301)]
                                                  for name in fp8_curves.RUNS}}
    (tmp_path / "curves.json").write_text(json.dumps(data))
    fp8_curves.plot(str(tmp_path / "curves.json"), str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_recompute_host_benchmark_times_its_three_runs(capsys):
    """benchmarks/recompute_host.py on a CPU: no recomputation, tessera's node and torch's checkpoint,
    each timed (no threshold: the figures are BENCHMARKS.md's), tessera's node put back after."""
    import recompute_host

    import tessera.tensor_parallel.random as rng

    node = rng._Recomputed
    medians = recompute_host.main(["--rounds", "1", "--steps", "1"])
    assert set(medians) == {"none", "full, tessera's node", "full, torch.utils.checkpoint"}
    assert all(t > 0 for t in medians.values()) and rng._Recomputed is node
    assert "recomputation adds" in capsys.readouterr().out


def test_the_attention_benchmark_times_what_runs_and_names_what_refuses():
    """On a CPU with a tiny shape: SDPA's own choice and flash (the CPU has a flash kernel) are
    timed, forward and backward; cuDNN and the memory-efficient kernel, which it lacks, are listed
    as refused, with the reason."""
    import torch
    from attention_backends import table
    from sweep import Shape

    rows = table([Shape("tiny", 32, 1, 4, 2, 64, 16, 64, 1)], repeats=2, device=torch.device("cpu"))
    by_backend = {row.split(" | ")[1]: row for row in rows[2:]}
    assert set(by_backend) == {"cudnn", "flash", "efficient", "sdpa's choice"}
    for name in ("sdpa's choice", "flash"):
        cells = by_backend[name].split(" | ")
        # (both timed; not compared: a busy machine's clock can put either first)
        assert float(cells[2]) > 0 and float(cells[3]) > 0, by_backend[name]
    assert all("refused: No viable backend" in by_backend[name] for name in ("cudnn", "efficient"))


def test_kernel_split_sorts_kernels_by_kind_and_sets_two_profiles_side_by_side():
    """kernel_split.py: each kind of kernel found by name (cuDNN's attention by direction, inductor's,
    cuBLAS's, the fused AdamW's), ms per step summed, and a second profile given as its difference."""
    import kernel_split

    assert [kernel_split.kind(n) for n in (
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
        "triton_per_fused__to_copy_mul_rsqrt_0", "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN",
        "void at::native::(anonymous namespace)::fused_adamw_kernel<float>",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "void at::native::vectorized_elementwise_kernel<4, silu>",
        "triton_poi_fused__scaled_dot_product_cudnn_attention_backward_0", "fmha_cutlassB_bf16_aligned_64x64_k64_sm80",
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, at::native::LpNormFunctor<float>>",
        "Memcpy DtoD (Device -> Device)")] == [
        "attention forward", "attention backward", "inductor (triton)", "GEMM", "optimizer", "copies", "NCCL",
        "other eager", "inductor (triton)", "attention backward", "gradient norm", "copies"]
    mine = {"steps": 2, "wall_us": 2000.0, "kernels": {"nvjet_tst_a": [1200.0, 8], "triton_poi_fused_b": [400.0, 4]}}
    peer = {"steps": 2, "wall_us": 2600.0, "kernels": {"nvjet_tst_a": [1400.0, 8], "triton_poi_fused_c": [600.0, 6],
                                                        "fused_adamw_kernel": [200.0, 2]}}
    per_kind, kernels, wall = kernel_split.split(peer)
    assert per_kind == pytest.approx({"GEMM": 0.7, "inductor (triton)": 0.3, "optimizer": 0.1}) and wall == 1.3
    assert kernels["GEMM"] == [(pytest.approx(0.7), "nvjet_tst_a")]
    lines = kernel_split.table({"tessera": mine, "torch": peer})
    assert lines[0] == "| kind | tessera ms/step | torch ms/step | torch - tessera |"
    assert "| GEMM | 0.6 | 0.7 | +0.1 |" in lines and "| optimizer | 0.0 | 0.1 | +0.1 |" in lines
    assert "| kernels, all | 0.8 | 1.1 | +0.3 |" in lines and "| wall | 1.0 | 1.3 | +0.3 |" in lines


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_kernel_split_profiles_an_unchanged_script_through_its_optimizer_steps(tmp_path):
    """A plain PyTorch loop run under kernel_split.py's environment writes the profile of its 2nd and
    3rd steps: GEMMs and the fused AdamW among its kernels."""
    import kernel_split

    script = tmp_path / "loop.py"
    script.write_text("import torch\nm = torch.nn.Linear(256, 256).cuda()\n"
                      "opt = torch.optim.AdamW(m.parameters(), fused=True)\nfor _ in range(5):\n"
                      "    m(torch.randn(64, 256, device='cuda')).square().mean().backward()\n"
                      "    opt.step()\n")
    prefix = str(tmp_path / "split")
    subprocess.run([sys.executable, str(script)], check=True, env={**os.environ, **kernel_split.profiled_env(prefix)})
    profile = kernel_split.collected(prefix)
    per_kind, _, wall = kernel_split.split(profile)
    assert profile["steps"] == 2 and per_kind["GEMM"] > 0 and per_kind["optimizer"] > 0 and wall > 0
    assert profile["idle_us"] > 0 and all(len(gap) == 3 for gap in profile["gaps"])


def test_the_adamw_benchmark_times_each_way_of_calling_the_fused_step(monkeypatch, capsys):
    """adamw_step.py on a CPU with a tiny model: the fused AdamW step timed as separate tensors and
    as views of one buffer (one storage), with and without grad_scale / found_inf, and its table."""
    import adamw_step
    import torch

    sizes = adamw_step.shapes(1, 64, 16, 128, 256)
    assert sizes[:2] == [(96, 64), (64, 64)] and sizes[-1] == (64,)
    ps = adamw_step.parameters(sizes, flat=True, device="cpu")
    assert len({p.untyped_storage().data_ptr() for p in ps}) == 1 and all(p.grad is not None for p in ps)
    for flat, scaled in [(False, False), (True, True)]:
        assert adamw_step.time_step(sizes, flat, scaled, groups=scaled, device="cpu", steps=1) > 0
    monkeypatch.setattr(sys, "argv", ["adamw_step.py", "--layers", "0", "--device", "cpu"])
    adamw_step.main()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 7 and all("ms/step" in line for line in out[1:])


def test_the_embedding_gradient_benchmark_times_four_ways_that_agree(monkeypatch, capsys):
    """embedding_grad.py on a CPU: Zipf ids repeat (far fewer distinct than uniform ones), and the
    dense, scatter, sorted and sum-then-scatter ways give one main gradient on both."""
    import embedding_grad
    import torch

    g = torch.Generator().manual_seed(0)
    uniform, zipf = (embedding_grad.token_ids(2048, 5000, z, g) for z in (False, True))
    assert zipf.unique().numel() < uniform.unique().numel() // 2 and (zipf < 10).float().mean() > 0.2
    monkeypatch.setattr(sys, "argv", ["embedding_grad.py", "--device", "cpu", "--tokens", "256", "--hidden", "32",
                                      "--vocab", "500", "--reps", "1"])
    embedding_grad.main()
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["uniform", "zipf"]
    assert all("dense" in line and "sorted" in line and "sums" in line and "DISAGREE" not in line for line in out)


@pytest.mark.slow
def test_kernel_splits_hook_lets_the_systems_sitecustomize_run_and_leaves_a_cpu_run_alone(tmp_path):
    """The hook folder's sitecustomize.py runs the next one on the path (a system's), and a script
    that steps an optimizer without a GPU runs as before and writes no profile."""
    import kernel_split

    (tmp_path / "system").mkdir()
    (tmp_path / "system" / "sitecustomize.py").write_text("import os\nos.environ['SYSTEM_SITE'] = 'ran'\n")
    prefix = str(tmp_path / "split")
    env = {**os.environ, **kernel_split.profiled_env(prefix), "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] += os.pathsep + str(tmp_path / "system")
    script = ("import os, torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.AdamW(m.parameters())\n"
              "for _ in range(4):\n    m(torch.ones(2, 4)).sum().backward()\n    opt.step()\n"
              "print(os.environ.get('SYSTEM_SITE'))\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ran" and kernel_split.collected(prefix) is None


def test_kernel_split_finds_the_stretches_without_a_kernel_and_prints_them():
    """The hook's gaps(): the time between kernels on any stream (overlapping kernels leave none),
    longest first with the kernels either side, counted from the end of the marker kernel that
    starts the profiled steps; the table prints them per profile."""
    import importlib.util

    import kernel_split

    spec = importlib.util.spec_from_file_location("kernel_split_site", kernel_split.HOOK / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    spans = [(0.0, 10.0, "a"), (5.0, 20.0, "b"), (25.0, 30.0, "c"), (30.0, 31.0, "d"), (131.0, 140.0, "e")]
    idle, longest = site.gaps(spans)
    assert idle == 105.0 and longest == [(100.0, "d", "e"), (5.0, "b", "c")]
    assert site.gaps([]) == (0.0, [])
    # the window starts where the marker kernel ends: the step before it and the marker do not
    # count, a kernel of another stream running across its end counts from there
    marked = [(0.0, 50.0, "adam"), (52.0, 53.0, "spin_kernel(long)"), (50.0, 55.0, "nccl"), (60.0, 70.0, "copy"),
              (75.0, 90.0, "gemm")]
    kept, start, wall = site.after_marker(marked)
    assert kept == [(53.0, 55.0, "nccl"), (60.0, 70.0, "copy"), (75.0, 90.0, "gemm")] and (start, wall) == (53.0, 37.0)
    assert site.gaps([(start, start, "spin_kernel")] + kept)[0] == 10.0
    assert site.after_marker(marked[3:]) == (marked[3:], 60.0, 30.0) and site.after_marker([]) == ([], 0.0, 0.0)
    profile = {"steps": 1, "wall_us": 140.0, "kernels": {"a": [10.0, 1]}, "idle_us": idle, "gaps": longest}
    lines = kernel_split.table({"tessera": profile})
    assert "  idle tessera: 0.1 ms per step between kernels; longest:" in lines
    assert any(line.strip().startswith("0.10 ms after d | before e") for line in lines)
