"""GPU paths of two GPUs and more (skipped with fewer; run on a machine of several GPUs): NCCL
tensor, pipeline and data parallelism, graphed and compiled layers under them, each against one GPU."""

import json
import re
import subprocess
import sys

import pytest
import torch

from gpu_runs import all_follow, follows, train_run

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(540)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_tensor_parallel_matches_one_gpu(tmp_path):
    """tp=2 with SP (eager, and with the TP communication overlap) and dp=2 on NCCL follow one GPU (fp32; fused weight gradients where auto picks them; eager
    layers: graphed ones have their own tests)."""
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    one = train_run(tmp_path, "one", 1, [])
    runs = {"tp2": sp + ["train.cuda_graphs=false"], "tp2-overlap": sp + ["parallel.tp_comm_overlap=true"],
            "dp2": []}
    all_follow(tmp_path, one, runs, timeout=80)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_compiled_tensor_parallel_matches_one_gpu(tmp_path):
    """Compiled layers at tp=2 + SP follow one GPU over NCCL (they drifted 5.2e-4 by step 8 while
    the compiled code ran dynamo's functional collectives; the TP collectives are opaque custom
    ops since: mappings.py, BENCHMARKS.md Fast-path safety)."""
    one = train_run(tmp_path, "one", 1, ["train.compile=true"])
    follows(one, train_run(tmp_path, "tp2", 2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                 "train.compile=true"]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graphed_layers_follow_eager_layers(tmp_path):
    """train.cuda_graphs replays the eager layers' kernels: the same fp32 curve on one GPU and at
    tp=2 with SP over NCCL (the collectives captured in the graphs)."""
    one = train_run(tmp_path, "one", 1, [])
    follows(one, train_run(tmp_path, "one-graphs", 1, ["train.cuda_graphs=true"]), rel=1e-5)
    follows(one, train_run(tmp_path, "tp2-graphs", 2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                        "train.cuda_graphs=true"]))


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graphed_layers_without_sp_and_at_dp2_follow_one_gpu(tmp_path):
    """The other layouts auto may graph: tp=2 without SP (all-reduces captured) and, with the
    graphs asked for, dp=2 (the data-parallel gradient hooks and bucket reductions fed by the
    graphs' weight gradients); and with fused weight gradients captured in the graphs at tp=2 +
    SP."""
    one = train_run(tmp_path, "one", 1, [])
    all_follow(tmp_path, one, {"tp2-nosp-graphs": ["parallel.tp=2"],
                                "dp2-graphs": ["train.cuda_graphs=true", "parallel.zero=1",
                                               "parallel.overlap_param_gather=false"],
                                # the weight-gradient GEMMs captured in the graphs, adding into
                                # the buffers
                                "tp2-sp-graphs-fused": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                        "train.grad_accum_fusion=true"]},
                timeout=110)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graphed_layers_under_the_overlapped_gather_follow_one_gpu(tmp_path):
    """Graphed layers at dp=2 under zero 1/2's overlapped parameter gather (its waits lifted for
    the capture, then run before each replay: a replay that read parameters before their gather
    landed would drift from one GPU), without and with fused weight gradients (whose arrivals,
    reported after each layer's replay, start the bucket reductions)."""
    one = train_run(tmp_path, "one", 1, [])
    all_follow(tmp_path, one, {"dp2-graphs-gather": ["train.cuda_graphs=true", "parallel.zero=1"],
                                "dp2-graphs-gather-zero2": ["train.cuda_graphs=true", "parallel.zero=2"],
                                "dp2-graphs-fused": ["train.cuda_graphs=true", "train.grad_accum_fusion=true",
                                                     "parallel.zero=1"]},
                timeout=110)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graphed_overlapped_tp_paths_follow_one_gpu(tmp_path):
    """The overlapped TP backward captured in the layers' graphs follows one GPU: at tp=2 + SP the
    asynchronous reduce-scatter (auto's choice with graphs), at tp=2 without SP the asynchronous
    all-reduce; and the plain collectives (tp_comm_overlap=false)."""
    one = train_run(tmp_path, "one", 1, [])
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.cuda_graphs=true"]
    all_follow(tmp_path, one, {"graphs-overlap-nosp": ["parallel.tp=2", "train.cuda_graphs=true",
                                                        "parallel.tp_comm_overlap=true"],
                                "graphs-overlap": sp + ["parallel.tp_comm_overlap=true"],
                                "graphs-plain": sp + ["parallel.tp_comm_overlap=false"]}, timeout=110)


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_pipeline_schedules_match_one_gpu(tmp_path):
    base = ["model.layers=4"]
    one = train_run(tmp_path, "pp1", 1, base)
    for kind, vpp in [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("interleaved-zb", 2), ("gpipe", 1)]:
        curve = train_run(tmp_path, kind, 2, base + ["parallel.pp=2", f"parallel.vpp={vpp}", f"parallel.schedule={kind}"])
        for a, b in zip(one, curve):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), kind


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_compiled_layers_under_the_split_backward_match_one_gpu(tmp_path):
    """Whole compiled llama layers at pp=2 under interleaved-zb: their deferred weight gradients
    go through tessera's opaque ops (tensor_parallel/wgrad.py), filed in I and run in W, and the
    run follows one GPU's compiled layers on NCCL (fp32)."""
    base = ["model.family=llama", "model.kv_heads=2", "model.layers=4", "train.compile=true"]
    one = train_run(tmp_path, "one", 1, base)
    # (the path taken is the CPU-tested one: no graph break, tests/test_wgrad.py)
    curve = train_run(tmp_path, "zb-compiled", 2, base + ["parallel.pp=2", "parallel.vpp=2",
                                                       "parallel.schedule=interleaved-zb"])
    assert "layers compiled" in (tmp_path / "zb-compiled" / "output.log").read_text()
    for a, b in zip(one, curve):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_uneven_default_layout_matches_one_gpu(tmp_path):
    """The default layout at vpp=2 (auto: balanced) with 5 layers: an uneven 2,1,1,1; and
    the run's end reports both stages' peak memory."""
    five = ["model.layers=5"]
    one = train_run(tmp_path, "pp1-five", 1, five)
    curve = train_run(tmp_path, "vpp2-five", 2, five + ["parallel.pp=2", "parallel.vpp=2"])
    for a, b in zip(one, curve):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), "vpp2-five"
    out = (tmp_path / "vpp2-five" / "output.log").read_text()
    assert "layers per stage [2, 1, 1, 1]" in out
    peaks = re.search(r"peak memory per rank \(GiB\): \[([\d.]+), ([\d.]+)\]", out)  # both stages reported
    assert peaks and all(float(g) > 0 for g in peaks.groups()), out[-2000:]


@pytest.mark.timeout(540)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_zero_matches_one_gpu(tmp_path):
    one = train_run(tmp_path, "one", 1, [])
    runs = [(f"zero{zero}", [f"parallel.zero={zero}"]) for zero in (0, 1, 2, 3)]
    for name, sets in runs:
        curve = train_run(tmp_path, name, 2, [*sets, "parallel.bucket_size=100000"])
        for a, b in zip(one, curve):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), name
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), name


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_bf16_follows_one_gpu(tmp_path):
    """A bf16 model at dp=2 over NCCL against one GPU: bf16 gradient buffers at zero 0 and 1
    (sent as bf16 through the fp32-summing all-to-all), fp32 ones at zero 2 and 3."""
    bf16 = train_run(tmp_path, "bf16", 1, ["train.dtype=bf16"])
    for zero, grads in ((0, "bf16"), (1, "bf16"), (2, "fp32"), (3, "fp32")):
        curve = train_run(tmp_path, f"bf16-zero{zero}", 2, ["train.dtype=bf16", f"parallel.zero={zero}",
                                                         f"train.grad_dtype={grads}", "parallel.bucket_size=100000"])
        for b, c in zip(bf16, curve):
            assert c["loss"] == pytest.approx(b["loss"], rel=2e-2), (zero, grads)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_rng_tracker_seeds_its_own_device_not_the_current_one():
    """A tracker for cuda:1 made while cuda:0 is current: its tp stream is the one seeded for it
    (before, the seed went to cuda:0's generator and cuda:1's tp stream was its default one)."""
    from tessera.tensor_parallel.random import RNGTracker

    torch.cuda.set_device(0)
    torch.cuda.manual_seed_all(1)
    before = [torch.cuda.get_rng_state(d) for d in (0, 1)]
    tracker = RNGTracker("cuda:1")
    tracker.add("tp", 1234)
    assert all(torch.equal(a, torch.cuda.get_rng_state(d)) for d, a in zip((0, 1), before))
    with tracker.fork("tp"):
        drawn = torch.rand(4, device="cuda:1")
    want = torch.rand(4, device="cuda:1", generator=torch.Generator("cuda:1").manual_seed(1234))
    assert torch.equal(drawn, want)


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_checkpoint_loads_into_other_layouts(tmp_path):
    """A tp=2 + SP checkpoint (NCCL, CUDA graphs) trains on at dp=2 under zero 1 and FSDP as the
    tp=2 run went on."""
    straight = train_run(tmp_path, "tp2", 2, ["parallel.tp=2", "parallel.sequence_parallel=true", "optim.decay_steps=8",
                                           "checkpoint.save_every=4", f"checkpoint.dir={tmp_path}/ck"])
    load = [f"checkpoint.load={tmp_path}/ck/step_00000004", "optim.decay_steps=8"]
    all_follow(tmp_path, straight[4:], {"dp2-zero1": load + ["parallel.zero=1"],
                                         "dp2-zero3": load + ["parallel.zero=3"]})


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_generation_and_evaluation_at_tp2_and_pp2_match_one_gpu(tmp_path):
    """tessera generate (eager and CUDA-graphed at tp=2, eager at pp=2) and tessera eval on NCCL
    print what one GPU prints, from a checkpoint a short run saved (fp32: the tp=2 sums differ from
    one GPU's in the last bits, far below the gaps between the trained model's logits)."""
    sets = ["model.hidden=64", "model.layers=2", "model.seq_len=64", "train.steps=60", "optim.lr=3e-3",
            "train.micro_batch=2",
            "train.global_batch=4", f"checkpoint.dir={tmp_path}/ck", f"train.out_dir={tmp_path}/out"]
    train = subprocess.run([sys.executable, "-m", "tessera", "train", *[a for s in sets for a in ("--set", s)]],
                           capture_output=True, text=True, timeout=200)
    assert train.returncode == 0, train.stderr[-2000:]

    def tessera(*args, nproc=1):
        launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
        done = subprocess.run([sys.executable, "-m", "tessera", *args, "--checkpoint", f"{tmp_path}/ck", *launch],
                              capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    generate = ["generate", "--prompt", "The ", "--prompt", "def ", "--max-new-tokens", "80", "--temperature", "0",
                "--json", "--no-stop"]
    one = tessera(*generate)
    assert tessera(*generate, "--cuda-graph") == one
    assert tessera(*generate, "--set", "parallel.tp=2", nproc=2) == one
    assert tessera(*generate, "--set", "parallel.tp=2", "--cuda-graph", nproc=2) == one
    assert tessera(*generate, "--set", "parallel.pp=2", nproc=2) == one
    figure = json.loads(tessera("eval", "--json"))
    for layout in (["--set", "parallel.tp=2"], ["--set", "parallel.pp=2"], []):
        assert json.loads(tessera("eval", "--json", *layout, nproc=2))["loss"] == pytest.approx(figure["loss"], rel=1e-5)
