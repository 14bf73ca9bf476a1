"""End to end: the trainer gives the same per-step losses (and gradient norms) at tp=1, tp=2,
tp=2 x dp=2, the pipeline layouts and under a batch ramp-up, from the same seed and data: the
layout never changes the maths.

``tessera train`` itself runs once, through its launcher (torchrun, 2 processes), against the
one-process curve. The other layouts run ``train`` (what each torchrun worker runs) in rank
processes: one ``run_ranks`` call per world size (``RUNS``), whose results the tests share."""

import pytest

from parity import assert_same_curve
from training_runs import TINY, run_train, shared_result, train_outputs

pytestmark = pytest.mark.slow  # (several trainings per world size, 30 s to 2 min per call)

GPT2 = ["model.family=gpt2", "data.source=builtin"]
LLAMA = ["model.family=llama", "data.source=synthetic", "model.kv_heads=2", "model.tie_embeddings=false"]
TP2, SP = ["parallel.tp=2"], ["parallel.sequence_parallel=true"]
# (4 layers; the closing sample: generation sends other shapes over the trainer's pipeline P2P,
# which otherwise keeps the training shapes)
PIPE = ["model.layers=4", "data.source=builtin", "train.sample_tokens=6"]
FIVE = ["model.layers=5", "data.source=builtin"]
# global batch 4 -> 8 over the first 8 samples (2 then 4 micro-batches of 2 per step)
RAMP = ["data.source=synthetic", "model.layers=2", "train.batch_rampup=4,4,8", "train.steps=6"]
EAGER = ["data.source=synthetic", "model.layers=2", "train.steps=4"]
RUNS = {  # (name, overrides) per world size; the one-process references first
    1: [("gpt2", GPT2), ("llama", LLAMA), ("fp32", ["data.source=synthetic"]), ("pipe", PIPE), ("five", FIVE),
        ("ramp", RAMP), ("eager", EAGER)],
    2: [("gpt2-tp2", GPT2 + TP2), ("llama-tp2", LLAMA + TP2),
        ("bf16-tp2", ["data.source=synthetic", "train.dtype=bf16"] + TP2),
        ("pipe-pp2-vpp2", PIPE + ["parallel.pp=2", "parallel.vpp=2"]),
        # 5 layers: the even split is refused at pp=2, the balanced one gives 3/2; at vpp=2 the
        # default (auto) is balanced: an uneven 2,1,1,1
        ("five-balanced", FIVE + ["parallel.pp=2", "parallel.pp_layout=Balanced"]),
        ("five-vpp2-auto", FIVE + ["parallel.pp=2", "parallel.vpp=2"]),
        ("ramp-pp2", RAMP + ["parallel.pp=2", "parallel.schedule=1f1b"])],
    # train.compile=true (inductor's CPU backend here) at tp=2 with SP, and at pp=2 under ZB-H1
    # with gradient-accumulation fusion, whose linear layers run eagerly between compiled pieces
    "2-compiled": [("compiled-tp2-sp", EAGER + ["train.compile=true"] + TP2 + SP),
                   ("compiled-zb", EAGER + ["train.compile=true", "parallel.pp=2", "parallel.schedule=zb-h1",
                                            "train.grad_accum_fusion=true"])],
    4: [("gpt2-tp2-dp2-sp", GPT2 + TP2 + SP), ("llama-tp2-dp2-sp", LLAMA + TP2 + SP),
        ("pipe-tp2-pp2", PIPE + TP2 + ["parallel.pp=2"]), ("pipe-pp4", PIPE + ["parallel.pp=4", "parallel.schedule=1f1b"])],
}
_RESULTS: dict = {}


def results(tmp_path_factory, key) -> dict[str, tuple[list[dict], str]]:
    """Each run of ``RUNS[key]``: its history and what its logging rank printed."""
    def compute():
        tmp = tmp_path_factory.mktemp(f"layouts-{key}")
        runs = [sets + [f"train.out_dir={tmp / name}"] for name, sets in RUNS[key]]
        world = key if isinstance(key, int) else int(key.split("-")[0])
        outputs = train_outputs(world, TINY, runs, timeout=600)
        return {name: out for (name, _), out in zip(RUNS[key], outputs)}
    return shared_result(_RESULTS, key, compute)


def curve(tmp_path_factory, name: str) -> list[dict]:
    key = next(k for k, runs in RUNS.items() if name in dict(runs))
    return results(tmp_path_factory, key)[name][0]


def printed(tmp_path_factory, name: str) -> str:
    key = next(k for k, runs in RUNS.items() if name in dict(runs))
    return results(tmp_path_factory, key)[name][1]


@pytest.mark.timeout(600)
def test_tessera_train_through_the_launcher_follows_the_one_process_curve(tmp_path, tmp_path_factory):
    """The command (torchrun, 2 processes at tp=2 + SP): its metrics.jsonl, one console line per
    log_every, the one-process run's curve."""
    launched, stdout = run_train(tmp_path / "tp2", 2, GPT2 + TP2 + SP)
    assert len(launched) == 10
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(launched[0])
    assert "step     5 | loss" in stdout
    assert_same_curve(curve(tmp_path_factory, "gpt2"), launched)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_same_losses_on_every_layout(tmp_path_factory, family):
    reference = curve(tmp_path_factory, family)
    assert len(reference) == 10
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(reference[0])
    assert reference[-1]["loss"] < reference[0]["loss"], "the loss falls"
    assert "step     5 | loss" in printed(tmp_path_factory, family)  # one line per log_every
    for layout in ("tp2", "tp2-dp2-sp"):
        assert_same_curve(reference, curve(tmp_path_factory, f"{family}-{layout}"), what=f"{family} {layout}")


@pytest.mark.timeout(600)
def test_bf16_trains_close_to_fp32(tmp_path_factory):
    fp32, bf16 = curve(tmp_path_factory, "fp32"), curve(tmp_path_factory, "bf16-tp2")
    assert len(bf16) == len(fp32) == 10
    for a, b in zip(fp32, bf16):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


@pytest.mark.timeout(600)
def test_pipeline_layouts_give_the_same_losses(tmp_path_factory):
    reference = curve(tmp_path_factory, "pipe")
    for name in ("pipe", "pipe-tp2-pp2", "pipe-pp2-vpp2", "pipe-pp4"):
        samples = [line for line in printed(tmp_path_factory, name).splitlines() if line.startswith("sample: ")]
        assert len(samples) == 1, (name, printed(tmp_path_factory, name)[-2000:])
        assert_same_curve(reference, curve(tmp_path_factory, name), what=name)
    reference = curve(tmp_path_factory, "five")
    for name in ("five-balanced", "five-vpp2-auto"):
        assert_same_curve(reference, curve(tmp_path_factory, name), what=name)
    said = printed(tmp_path_factory, "five-vpp2-auto")
    assert "layers per stage [2, 1, 1, 1] (pp_layout=auto)" in said, said[-2000:]


@pytest.mark.timeout(600)
def test_batch_rampup_trains_and_pipelines_follow_it(tmp_path_factory):
    one = curve(tmp_path_factory, "ramp")
    tokens = [m["tokens"] for m in one]
    assert tokens[0] == 4 * 32 and tokens[-1] == 8 * 32 and tokens == sorted(tokens), tokens
    assert_same_curve(one, curve(tmp_path_factory, "ramp-pp2"))


@pytest.mark.timeout(900)
def test_compiled_layers_follow_the_eager_curve(tmp_path_factory):
    eager = curve(tmp_path_factory, "eager")
    for name in ("compiled-tp2-sp", "compiled-zb"):
        assert_same_curve(eager, curve(tmp_path_factory, name), rel=1e-4, what=name)
