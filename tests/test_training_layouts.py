"""End to end: `tessera train` gives the same per-step losses (and gradient norms) at tp=1, tp=2
and tp=2 x dp=2 from the same seed and data: the layout never changes the maths."""

import pytest

from parity import assert_same_curve
from training_runs import run_train

pytestmark = pytest.mark.slow  # (tessera train runs, 20 s to 2 min each)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family,extra", [
    ("gpt2", ["data.source=builtin"]),
    ("llama", ["data.source=synthetic", "model.kv_heads=2", "model.tie_embeddings=false"]),
])
def test_same_losses_on_every_layout(tmp_path, family, extra):
    base = [f"model.family={family}", *extra]
    reference, stdout = run_train(tmp_path / "tp1", 1, base)
    assert len(reference) == 10
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(reference[0])
    assert reference[-1]["loss"] < reference[0]["loss"], "the loss falls"
    assert "step     5 | loss" in stdout  # one console line per log_every
    tp2, _ = run_train(tmp_path / "tp2", 2, base + ["parallel.tp=2"])
    assert_same_curve(reference, tp2)
    tp2_dp2, _ = run_train(tmp_path / "tp2dp2", 4, base + ["parallel.tp=2", "parallel.sequence_parallel=true"])
    assert_same_curve(reference, tp2_dp2)


@pytest.mark.timeout(200)
def test_bf16_trains_close_to_fp32(tmp_path):
    fp32, _ = run_train(tmp_path / "fp32", 1, ["data.source=synthetic"])
    bf16, _ = run_train(tmp_path / "bf16", 2, ["data.source=synthetic", "train.dtype=bf16", "parallel.tp=2"])
    for a, b in zip(fp32, bf16):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


@pytest.mark.timeout(500)
def test_pipeline_layouts_give_the_same_losses(tmp_path):
    # and the closing sample: generation sends other shapes over the trainer's pipeline P2P,
    # which otherwise keeps the training shapes
    base = ["model.layers=4", "data.source=builtin", "train.sample_tokens=6"]
    reference, ref_out = run_train(tmp_path / "pp1", 1, base)
    ref_sample = [line for line in ref_out.splitlines() if line.startswith("sample: ")]
    assert len(ref_sample) == 1, ref_out[-2000:]
    for name, nproc, layout in [
        ("tp2pp2", 4, ["parallel.tp=2", "parallel.pp=2"]),
        ("pp2vpp2", 2, ["parallel.pp=2", "parallel.vpp=2"]),
        ("pp4", 4, ["parallel.pp=4", "parallel.schedule=1f1b"]),
    ]:
        curve, stdout = run_train(tmp_path / name, nproc, base + layout)
        assert_same_curve(reference, curve)
        assert len([line for line in stdout.splitlines() if line.startswith("sample: ")]) == 1, stdout[-2000:]
    # 5 layers: the even split is refused at pp=2, the balanced one gives 3/2; at vpp=2
    # the default (auto) is balanced: an uneven 2,1,1,1
    five = ["model.layers=5", "data.source=builtin"]
    reference, _ = run_train(tmp_path / "five-pp1", 1, five)
    curve, _ = run_train(tmp_path / "five-balanced", 2, five + ["parallel.pp=2", "parallel.pp_layout=Balanced"])
    assert_same_curve(reference, curve)
    curve, stdout = run_train(tmp_path / "five-vpp2-auto", 2, five + ["parallel.pp=2", "parallel.vpp=2"])
    assert_same_curve(reference, curve)
    assert "layers per stage [2, 1, 1, 1] (pp_layout=auto)" in stdout, stdout[-2000:]


@pytest.mark.timeout(300)
def test_batch_rampup_trains_and_pipelines_follow_it(tmp_path):
    # global batch 4 -> 8 over the first 8 samples (2 then 4 micro-batches of 2 per step)
    ramp = ["data.source=synthetic", "model.layers=2", "train.batch_rampup=4,4,8", "train.steps=6"]
    one, _ = run_train(tmp_path / "one", 1, ramp)
    tokens = [m["tokens"] for m in one]
    assert tokens[0] == 4 * 32 and tokens[-1] == 8 * 32 and tokens == sorted(tokens), tokens
    pp2, _ = run_train(tmp_path / "pp2", 2, ramp + ["parallel.pp=2", "parallel.schedule=1f1b"])
    assert_same_curve(one, pp2)


@pytest.mark.timeout(900)
def test_compiled_layers_follow_the_eager_curve(tmp_path):
    """train.compile=true (inductor's CPU backend here) at tp=2 with SP, and at pp=2 under ZB-H1
    with gradient-accumulation fusion, whose linear layers run eagerly between compiled pieces."""
    base = ["data.source=synthetic", "model.layers=2", "train.steps=4"]
    eager, _ = run_train(tmp_path / "eager", 1, base)
    compiled, _ = run_train(tmp_path / "compiled", 2, base + ["train.compile=true", "parallel.tp=2",
                                                              "parallel.sequence_parallel=true"], timeout=500)
    assert_same_curve(eager, compiled, rel=1e-4)
    zb, _ = run_train(tmp_path / "zb", 2, base + ["train.compile=true", "parallel.pp=2", "parallel.schedule=zb-h1",
                                                  "train.grad_accum_fusion=true"], timeout=500)
    assert_same_curve(eager, zb, rel=1e-4)
