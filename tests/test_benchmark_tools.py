"""The benchmark runner's plumbing (the GPU runs themselves happen on the GPU machine)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare  # noqa: E402


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
                lambda: compare.parse_skip("nemo@1gpu"), lambda: compare.parse_skip("mcore@tp4")):
        with pytest.raises(SystemExit) as err:
            bad()
        assert any(word in str(err.value) for word in ("dp3", "zero", "nemo", "tp4"))


def test_skip_takes_both_spellings():
    for spelling in (["--skip", "mcore@1gpu,torch@1gpu"], ["--skip=mcore@1gpu,torch@1gpu"]):
        out = subprocess.run([sys.executable, "benchmarks/compare.py", "gpt-1.3b", "1gpu", *spelling, "--dry-run"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
        assert len(out) == 1 and "quick_train.py" in out[0], spelling  # tessera alone


def test_step_jitter_reports_every_step_and_rank_on_gloo():
    """benchmarks/step_jitter.py on 2 CPU processes (dp=2, zero=1, a tiny model): a line per step
    with both ranks' phases, which add up to the step, and a summary per rank."""
    import os
    import re
    tiny = ["parallel.zero=1", "model.hidden=64", "model.heads=4", "model.layers=2", "model.seq_len=32",
            "model.vocab_size=256", "train.dtype=fp32", "train.global_batch=8"]
    env = {**os.environ, "STEPS": "4", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "step_jitter.py",
                          *tiny], cwd=ROOT / "benchmarks", capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("  step ")]
    assert len(steps) == 3, out.stdout  # steps 1-3 (step 0 has no previous end)
    for line in steps:
        for rank_cells in line.split(":", 1)[1].split("|"):
            step, idle, fb, sync, tail, lead = map(float, rank_cells.split())
            assert step > 0 and step == pytest.approx(idle + fb + sync + tail, abs=0.5), line
    assert len(re.findall(r"SUMMARY rank [01]: step median", out.stdout)) == 2


def test_gc_probe_times_both_kinds_of_collection_on_every_rank():
    """benchmarks/gc_probe.py on 2 CPU processes (dp=2, zero=1, a tiny model): per round and rank
    a collection with the host ahead and one after a sync, each with what it found (nothing
    here: training makes no garbage cycles on a CPU) and the heap frozen."""
    import os
    import re
    tiny = ["parallel.zero=1", "model.hidden=64", "model.heads=4", "model.layers=2", "model.seq_len=32",
            "model.vocab_size=256", "train.dtype=fp32", "train.global_batch=8"]
    env = {**os.environ, "WARM": "2", "STEPS": "1", "ROUNDS": "2", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "gc_probe.py", *tiny],
                         cwd=ROOT / "benchmarks", capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = re.findall(r"GC rank ([01]) round ([01]) (host ahead |after a sync): collect [0-9.]+ ms.*found (\d+), "
                       r"tracked after \d+ \(frozen (\d+)\)", out.stdout)
    assert sorted((rank, rnd, kind.strip()) for rank, rnd, kind, _, _ in lines) == sorted(
        (rank, rnd, kind) for rank in "01" for rnd in "01" for kind in ("host ahead", "after a sync")), out.stdout
    assert all(found == "0" and int(frozen) > 0 for *_, found, frozen in lines), out.stdout


def test_kernel_timeline_splits_time_by_what_runs_beside_what(tmp_path):
    """kernel_timeline.py: a timeline of two streams' kernels cut into idle, NCCL alone, compute
    alone, NCCL beside compute and two compute kernels at once (µs in the file, ms out)."""
    import gzip

    import kernel_timeline

    rows = ["0,1000,7,ncclDevKernel_AllGather", "500,2000,8,nvjet_gemm", "1500,2500,7,elementwise",
            "3000,4000,7,ncclDevKernel_ReduceScatter"]
    path = tmp_path / "kernels_x_rank0.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n")
    loaded = kernel_timeline.load(str(path))
    assert kernel_timeline.totals(loaded, steps=1) == pytest.approx(
        {"nccl alone": 1.5, "nccl beside compute": 0.5, "compute alone": 1.0, "compute x2+": 0.5, "idle": 0.5})
    assert kernel_timeline.summary(loaded, steps=1) == pytest.approx(
        {"busy": 3.5, "nccl": 2.0, "compute": 2.0, "beside": 0.5})  # (what kernel_table.py prints)
    first, second = kernel_timeline.binned(loaded, 2.0)
    assert first == (0.0, pytest.approx({"nccl alone": 0.25, "nccl beside compute": 0.25, "compute alone": 0.25,
                                         "compute x2+": 0.25}))
    assert second == (2.0, pytest.approx({"compute alone": 0.25, "idle": 0.25, "nccl alone": 0.5}))
    out = subprocess.run([sys.executable, "benchmarks/kernel_timeline.py", str(path), "--steps", "1"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "nccl beside compute 0.5" in out
