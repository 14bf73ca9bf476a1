"""Heterogeneous pipelines end to end (``parallel.stage_tp`` / ``stage_dp``): the trainer on
stages of different tp and dp sizes, joined by the bridge (zb-h1 as auto picks it, 1f1b and
gpipe), gives the one-process model's loss and gradient norm at every step, every gradient of a
step and the final weights (fp32, gloo): (tp=2, dp=1) -> (tp=1, dp=2),
(tp=1, dp=2) -> (tp=2, dp=1) with sequence parallelism and zero 1 or 2, and (tp=2) -> (tp=1) ->
(tp=2) on 5 ranks with tied embeddings; validation losses through the bridge are the one-process
ones; checkpoints move between heterogeneous and homogeneous layouts both ways and continue the
same losses; layouts that cannot run are refused in words, the checks of every layout included."""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.dcp import read_whole
from tessera.config import ConfigError, load_config
from tessera.models import GPTModel
from tessera.testing import run_ranks
from tessera.training.preflight import check_runnable, validate

from parity import assert_close, assert_same_curve, compare_to_full, param_kind, tp_close
from training_runs import shared_result, train_histories

BASE = ["model.hidden=32", "model.heads=4", "model.seq_len=16", "model.vocab_size=256", "model.ffn_hidden=64",
        "data.source=builtin", "train.micro_batch=1", "train.global_batch=8", "train.steps=4", "train.log_every=1",
        "train.device=cpu", "optim.lr=3e-3", "optim.eps=1e-6", "optim.warmup=0", "optim.clip_grad=0.5", "train.seed=11"]
TWO = BASE + ["model.layers=2", "model.tie_embeddings=false"]
VALIDATED = TWO + ["train.eval_every=2", "train.eval_batches=1"]  # a validation loss after steps 2 and 4
THREE = BASE + ["model.layers=3"]
_RESULTS: dict = {}


def _reference(tmp, model):
    """The one-process run of ``model`` (its history, and where it saved its final checkpoint)."""
    def compute():
        out = f"{tmp}/ref_{len(_RESULTS)}"
        return train_histories(1, model, [[f"checkpoint.dir={out}", f"train.out_dir={out}_out"]])[0], out
    return shared_result(_RESULTS, tuple(model), compute)


def _runs(tmp, model, world, layout):
    """The one-process reference and the run on ``layout``, each saving its final checkpoint."""
    def compute():
        run = train_histories(world, model, [layout + [f"checkpoint.dir={tmp}/het", f"train.out_dir={tmp}/het_out",
                                                       "checkpoint.save_every=2"]], timeout=300)[0]
        return run, tmp
    ref, ref_dir = _reference(tmp, model)
    return (ref, ref_dir, *shared_result(_RESULTS, (tuple(model), tuple(layout)), compute))


CASES = {
    "tp2 -> dp2": (TWO, 4, ["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2"]),
    "dp2 -> tp2 sp zero1": (TWO, 4, ["parallel.pp=2", "parallel.stage_tp=1,2", "parallel.stage_dp=2,1",
                                     "parallel.sequence_parallel=true", "parallel.zero=1"]),
    "tp2 -> tp1 -> tp2": (THREE, 5, ["parallel.pp=3", "parallel.stage_tp=2,1,2", "parallel.stage_dp=1,1,1",
                                    "parallel.schedule=1f1b"]),
    # with validation losses, which walk the stages forward only through the same bridge
    "tp2 -> dp2 gpipe": (VALIDATED, 4, ["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2",
                                        "parallel.schedule=gpipe"]),
    "dp2 -> tp2 sp zero2": (VALIDATED, 4, ["parallel.pp=2", "parallel.stage_tp=1,2", "parallel.stage_dp=2,1",
                                           "parallel.sequence_parallel=true", "parallel.zero=2"]),
}


def _valid(history):
    return [(m["step"], m["valid_loss"]) for m in history if "valid_loss" in m]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_heterogeneous_pipeline_trains_as_one_process(tmp_path, name):
    model, world, layout = CASES[name]
    ref, ref_dir, run, tmp = _runs(tmp_path, model, world, layout)
    assert len(ref) == 4 and ref[-1]["loss"] < ref[0]["loss"]
    assert_same_curve(ref, run, rel=1e-5, what=name)
    if "train.eval_every=2" in model:
        assert [s for s, _ in _valid(ref)] == [2, 4] and [s for s, _ in _valid(run)] == [2, 4], name
        assert [v for _, v in _valid(run)] == pytest.approx([v for _, v in _valid(ref)], rel=1e-5), name
    want, got = read_whole(f"{ref_dir}/step_00000004"), read_whole(f"{tmp}/het/step_00000004")
    assert want.keys() == got.keys()
    for key in want:
        tp_close(got[key], want[key], f"{name}: final {key}")  # (4 Adam steps amplify rounding)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_heterogeneous_checkpoint_continues_on_a_homogeneous_layout(tmp_path):
    """Saved at step 2 by (tp=1, dp=2) -> (tp=2, dp=1) under zero=1, loaded by tp=2 x pp=2 (weights
    and Adam's moments resharded): steps 3 and 4 are the one-process run's."""
    model, world, layout = CASES["dp2 -> tp2 sp zero1"]
    ref, _, _, tmp = _runs(tmp_path, model, world, layout)
    homogeneous = ["parallel.pp=2", "parallel.tp=2", f"checkpoint.load={tmp}/het/step_00000002",
                   f"train.out_dir={tmp_path}/cont_out"]
    (continued,) = train_histories(4, model, [homogeneous], timeout=300)
    assert_same_curve(ref[2:], continued, rel=1e-5, what="heterogeneous checkpoint, homogeneous continuation")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_load_into_heterogeneous_layouts(tmp_path):
    """tp=2 x pp=2 saves at step 2; (tp=2, dp=1) -> (tp=1, dp=2) loads it and saves at step 3;
    (tp=1, dp=2) -> (tp=2, dp=1) with sequence parallelism and zero=1 loads that (weights and Adam's
    moments resharded each time): every step is the one-process run's."""
    ref, _ = _reference(tmp_path, TWO)
    homogeneous = ["parallel.pp=2", "parallel.tp=2", f"checkpoint.dir={tmp_path}/homo", "checkpoint.save_every=2",
                   f"train.out_dir={tmp_path}/homo_out"]
    first = CASES["tp2 -> dp2"][2] + [f"checkpoint.load={tmp_path}/homo/step_00000002",
                                      f"checkpoint.dir={tmp_path}/het", "checkpoint.save_every=1",
                                      f"train.out_dir={tmp_path}/het_out"]
    second = CASES["dp2 -> tp2 sp zero1"][2] + [f"checkpoint.load={tmp_path}/het/step_00000003",
                                                f"train.out_dir={tmp_path}/het2_out"]
    saved, continued, again = train_histories(4, TWO, [homogeneous, first, second], timeout=400)
    assert_same_curve(ref, saved, rel=1e-5, what="tp=2 x pp=2")
    assert_same_curve(ref[2:], continued, rel=1e-5, what="homogeneous checkpoint, heterogeneous continuation")
    assert_same_curve(ref[3:], again, rel=1e-5, what="heterogeneous checkpoint, another heterogeneous layout")


REFUSED = [
    # (overrides, world size, key named in the error, words in the message)
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2"], 5, "parallel.stage_dp",
     "needs 2+2 = 4 ranks (stage_tp[s]*stage_dp[s] per stage), not the world size 5"),
    (["parallel.pp=2", "parallel.stage_tp=2,1,1", "parallel.stage_dp=1,2,1"], 4, "parallel.stage_tp",
     "has 3 entries for pp=2 stages"),
    (["parallel.pp=2", "parallel.stage_tp=2,1"], 4, "parallel.stage_dp", "is empty while the other"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "parallel.tp=2"], 4, "parallel.tp",
     "the stage lists set each stage's sizes"),
    (["parallel.pp=2", "parallel.stage_tp=3,1", "parallel.stage_dp=1,1"], 4, "model.heads",
     "not divisible by stage 0's tp=3"),
    (["parallel.pp=2", "parallel.stage_tp=1,1", "parallel.stage_dp=3,2"], 5, "train.micro_batch",
     "does not split over stage 1's dp=2"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "parallel.cp=2"], 4, "parallel.cp",
     "the bridge re-splits batch and sequence"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "parallel.zero=3"], 4, "parallel.zero",
     "FSDP shards over a dp device mesh"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "model.tie_embeddings=true"], 4,
     "model.tie_embeddings", "needs the two stages on equal grids"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2"], 4, "parallel.vpp",
     "neighbouring stages only"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "parallel.schedule=interleaved"], 4,
     "parallel.schedule", "interleaved with"),
    (["parallel.pp=2", "parallel.stage_tp=2,x", "parallel.stage_dp=1,2"], 4, "parallel.stage_tp",
     "not a list of integers"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "train.sample_tokens=4"], 4,
     "train.sample_tokens", "no path through the bridge yet"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "parallel.optimizer_offload=true"], 4,
     "parallel.optimizer_offload", "not proven on heterogeneous stages"),
    # the checks of every layout run with stage lists too
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "train.fp8=tensorwise", "train.dtype=fp16"], 4,
     "train.fp8", "with train.dtype=fp16"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "train.fused_elementwise=true"], 4,
     "train.fused_elementwise", "gpt2's LayerNorm and GELU"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "data.paths=corpus"], 4,
     "data.paths", "data.source=builtin reads no datasets"),
    (["parallel.pp=2", "parallel.stage_tp=1,1", "parallel.stage_dp=2,1", "parallel.sequence_parallel=true"], 3,
     "parallel.sequence_parallel", "needs tp > 1"),
    (["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2", "parallel.zero=2",
      "parallel.schedule=zb-h1"], 4, "parallel.schedule", "holds every zero=2 gradient bucket open"),
]


@pytest.mark.parametrize("overrides,world,key,words", REFUSED)
def test_layouts_that_cannot_run_are_refused_in_words(overrides, world, key, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, TWO + overrides), world)
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_equal_stage_grids_are_the_homogeneous_pipeline():
    cfg = validate(load_config(None, TWO + ["parallel.pp=2", "parallel.stage_tp=2,2", "parallel.stage_dp=1,1"]), 4)
    p = cfg.parallel
    assert (p.tp, p.dp, p.stage_tp, p.stage_dp) == (2, 1, [], [])
    het = check_runnable(load_config(None, TWO + ["parallel.pp=2", "parallel.stage_tp=2,1", "parallel.stage_dp=1,2",
                                                  "train.micro_batch=2"]), 4)
    assert het.parallel.dp == 2  # a pipeline micro-batch: micro_batch x the largest stage dp


def _gradients(rank, world, overrides):
    """One step's gradients as the optimizer gets them (dp-reduced and finalized), by name."""
    from tessera.training.build import build, build_topology
    from tessera.training.data_feed import DataFeed
    from tessera.training.step import train_step

    cfg = validate(load_config(None, overrides), world)
    topo = build_topology(cfg, torch.device("cpu"))
    parts = build(cfg, topo)
    names = {id(p): n for chunk in parts.chunks for n, p in chunk.named_parameters()}
    seen, grads, step = {}, parts.optimizer.grads, parts.optimizer.step

    def recording_grads():
        pairs = grads()
        seen["pairs"] = pairs
        return pairs

    def recording_step(*args, **kwargs):  # (after finalize_model_grads, before the update)
        seen.update({names[id(p)]: g.detach().reshape(p.shape).clone() for g, p in seen.pop("pairs")})
        return step(*args, **kwargs)

    parts.optimizer.grads, parts.optimizer.step = recording_grads, recording_step
    micro_batches = DataFeed(cfg, topo).next()
    train_step(parts.optimizer, micro_batches, topo, parts.executor(len(micro_batches)), parts.data_parallel,
               clip_grad=0.0)
    return topo.pp_rank, topo.tp_rank, topo.dp_rank, seen


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp2 -> dp2", "dp2 -> tp2 sp", "tp2 -> tp1 -> tp2"])
def test_every_gradient_is_the_one_process_models(name):
    model, world, layout = {**CASES, "dp2 -> tp2 sp": (TWO, 4, ["parallel.pp=2", "parallel.stage_tp=1,2",
                                                                "parallel.stage_dp=2,1",
                                                                "parallel.sequence_parallel=true"])}[name]
    ((_, _, _, want),) = run_ranks(_gradients, 1, model, timeout=120)
    got = run_ranks(_gradients, world, model + layout, timeout=300)
    cfg = load_config(None, model)
    with torch.device("meta"):
        whole = GPTModel(cfg.model)
    checked = set()
    for stage in sorted({r[0] for r in got}):
        ranks = [r for r in got if r[0] == stage]
        for param in ranks[0][3]:
            for dp_rank in sorted({r[2] for r in ranks}):
                shards = [r[3][param] for r in sorted(ranks, key=lambda r: r[1]) if r[2] == dp_rank]
                # the last stage's copy of a tied embedding: the embedding's whole gradient
                source = "embedding.weight" if param == "output.weight" and param not in want else param
                kind, sizes = param_kind(whole, source) if source == param else ("vocab", None)
                compare_to_full(kind, sizes, shards, want[source], f"{name}: stage {stage} dp {dp_rank} {param}",
                                cfg.model.vocab_size, check=assert_close)
            checked.add(param)
    tied = {"output.weight"} if cfg.model.tie_embeddings else set()
    assert checked == set(want) | tied, (set(want) | tied) ^ checked


def test_tessera_schedule_draws_heterogeneous_stages(tmp_path, capsys):
    """A stage on more ranks runs its share of a micro-batch faster: the simulator scales each
    stage's times by 1 / (tp * dp), and `tessera schedule --stage-tp/--stage-dp` draws it."""
    from tessera.cli import main
    from tessera.pipeline_parallel.schedules import build_all
    from tessera.pipeline_parallel.simulator import Costs, simulate

    assert Costs.stage_scale([2, 1, 2], [1, 1, 1]) == (0.5, 1.0, 0.5)
    timeline = simulate(build_all("1f1b", 3, 1, 6), 1, Costs(rank_scale=Costs.stage_scale([2, 1, 2], [1, 1, 1])))
    assert [timeline.busy(r) for r in range(3)] == [9.0, 18.0, 9.0]  # 6 x (F + B) = 18 on one rank
    assert main(["schedule", "--kind", "1f1b", "--stage-tp", "2,1,2", "--stage-dp", "1,1,1", "--microbatches", "6",
                 "--out", str(tmp_path / "het.svg")]) == 0
    out = capsys.readouterr().out
    assert "pp=3 vpp=1 stage_tp=2,1,2 stage_dp=1,1,1 microbatches=6: step time 20" in out
    assert "stage_tp=2,1,2" in (tmp_path / "het.svg").read_text()
    assert main(["schedule", "--stage-tp", "2,1"]) == 2
    assert "--stage-tp and --stage-dp give one size per stage each" in capsys.readouterr().err
