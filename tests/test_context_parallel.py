"""Context parallelism (``parallel.cp``) through the whole trainer: every layout with cp trains as
one process does (per-step losses and gradient norms, the final weights), GPT-2 and Llama with
GQA, packed documents crossing the chunk boundaries, composed with tp + SP, pp (interleaved), dp
at zero 1 and 3, recomputation and the validation loss; a run resumes at another cp; what cp
cannot run is refused before any work. The ring attention itself: tests/test_ring_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity import assert_same_curve
from tessera.checkpoint import dcp
from tessera.config import ConfigError, load_config
from tessera.data import IndexedDatasetWriter
from tessera.training.preflight import validate
from training_runs import shared_result, train_histories

EOD = 1
STEPS = 4  # (the validation loss at steps 2 and 4)
BASE = ["model.hidden=32", "model.layers=4", "model.heads=4", "model.seq_len=32", "model.vocab_size=64",
        "train.micro_batch=2", "train.global_batch=8", "train.seed=3", f"train.steps={STEPS}", "train.log_every=1",
        "data.source=synthetic", "optim.lr=3e-3", "optim.warmup=2", "train.eval_every=2", "train.eval_batches=1",
        # the key bias's gradient is zero in exact arithmetic (softmax ignores it): pure rounding
        # noise, which a tiny eps would turn into full-size, layout-dependent Adam steps
        "optim.eps=1e-6"]
LLAMA = ["model.family=llama", "model.kv_heads=2"]
RESULTS: dict = {}


def write_documents(prefix, seed: int = 0, docs: int = 200) -> None:
    """Short documents (1 to 12 tokens and an end of document): several per 32-token sample, so
    documents cross every chunk and rank boundary."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(docs):
            writer.add_document(np.append(rng.integers(2, 64, int(rng.integers(1, 13))), EOD))


def _weights(folder) -> dict[str, torch.Tensor]:
    whole = dcp.read_whole(str(folder / f"step_{STEPS:08d}"))
    return {k: v for k, v in whole.items() if k.startswith("model.")}


def _same_weights(got: dict, want: dict, what: str) -> None:
    """Every tensor within 1e-5 of the reference relative to its norm (Adam turns rounding-level
    gradient differences into single elements' last digits; the tensors stay equal as a whole)."""
    assert set(got) == set(want), what
    for name in want:
        error = (got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-12)
        assert error <= 1e-5, f"{what}: {name}: relative error {error:.2e}"


def packed_data(tmp_path) -> list[str]:
    """Documents written to ``tmp_path``, read packed: positions and attention reset per
    document, no loss on end-of-document predictions."""
    write_documents(tmp_path / "docs")
    return ["data.source=indexed", f"data.paths={tmp_path / 'docs'}", "data.split=90,10,0", f"data.eod_id={EOD}",
            "data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true",
            f"data.cache_dir={tmp_path / 'cache'}"]


def _runs(tmp_path, family: list[str]) -> dict[str, dict]:
    """For synthetic data and for packed documents: cp=1 on one rank; cp=2 and cp=4 and the
    composed layouts on four (one run_ranks call for both data): each run's history, its final
    weights (a checkpoint of the last step, the whole tensors)."""
    layouts = {"cp2": ["parallel.cp=2", "parallel.dp=2"], "cp4": ["parallel.cp=4"],
               "cp2-tp2-sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
               "cp2-pp2-vpp2": ["parallel.cp=2", "parallel.pp=2", "parallel.vpp=2"],
               "cp2-dp2-zero1": ["parallel.cp=2", "parallel.dp=2", "parallel.zero=1"],
               "cp2-dp2-zero3": ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"],
               "cp2-recompute": ["parallel.cp=2", "parallel.dp=2", "train.recompute=full"],
               "cp2-selective": ["parallel.cp=2", "parallel.dp=2", "train.recompute=selective"]}

    data = {"synthetic": [], "packed": packed_data(tmp_path)}

    def save(kind, name):
        return data[kind] + [f"checkpoint.dir={tmp_path / kind / name}", f"train.out_dir={tmp_path / kind / name}-out"]

    one = train_histories(1, BASE + family, [save(kind, "cp1") for kind in data], timeout=240)
    many = iter(train_histories(4, BASE + family, [sets + save(kind, name) for kind in data
                                                   for name, sets in layouts.items()], timeout=600))
    return {kind: {"cp1": (h, _weights(tmp_path / kind / "cp1")),
                   **{name: (next(many), _weights(tmp_path / kind / name)) for name in layouts}}
            for kind, h in zip(data, one)}


def results(tmp_path_factory, family: str) -> dict[str, dict]:
    return shared_result(RESULTS, family, lambda: _runs(tmp_path_factory.mktemp(f"cp-{family}"),
                                                         LLAMA if family == "llama" else []))


def _check(results: dict) -> None:
    reference, weights = results["cp1"]
    assert len({round(m["loss"], 6) for m in reference}) == len(reference), "every step moved the model"
    assert [m["step"] for m in reference if "valid_loss" in m] == [2, 4]
    for name, (history, final) in results.items():
        assert_same_curve(reference, history, rel=1e-5, what=name)
        valid = [(m["step"], m["valid_loss"]) for m in history if "valid_loss" in m]
        ref = [(m["step"], m["valid_loss"]) for m in reference if "valid_loss" in m]
        assert [s for s, _ in valid] == [s for s, _ in ref], name
        for (_, a), (_, b) in zip(ref, valid):
            assert b == pytest.approx(a, rel=1e-5), (name, a, b)
        _same_weights(final, weights, name)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_cp_layout_trains_as_one_process(tmp_path_factory, family):
    _check(results(tmp_path_factory, family)["synthetic"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_documents_across_chunks_train_as_one_process(tmp_path_factory, family):
    packed = results(tmp_path_factory, family)["packed"]
    assert all(m["tokens"] < 8 * 32 for m in packed["cp1"][0]), "end-of-document predictions carry no loss"
    _check(packed)


def _resume_runs(tmp_path) -> list[list[dict]]:
    base = BASE + LLAMA + ["train.steps=8", "train.eval_every=4", "checkpoint.save_every=4",
                           "optim.decay_steps=8"]  # (one schedule for 4 or 8 steps)
    straight = train_histories(1, base, [[f"checkpoint.dir={tmp_path}/straight", f"train.out_dir={tmp_path}/s"]])[0]
    first = train_histories(4, base, [["parallel.cp=2", "parallel.dp=2", "train.steps=4",
                                       f"checkpoint.dir={tmp_path}/cp2", f"train.out_dir={tmp_path}/a"]])[0]
    resumed = train_histories(4, base, [
        ["parallel.cp=4", f"checkpoint.load={tmp_path}/cp2", f"checkpoint.dir={tmp_path}/cp4", f"train.out_dir={tmp_path}/b"],
        ["parallel.cp=1", "parallel.dp=4", f"checkpoint.load={tmp_path}/cp2", f"checkpoint.dir={tmp_path}/dp4",
         f"train.out_dir={tmp_path}/c"]])
    return [straight, first, *resumed]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cp2_run_resumes_at_cp4_and_cp1_with_the_same_losses(tmp_path):
    straight, first, at_cp4, at_cp1 = _resume_runs(tmp_path)
    assert_same_curve(straight[:4], first, rel=1e-5, what="cp=2, steps 1-4")
    for name, resumed in (("cp=4", at_cp4), ("cp=1 dp=4", at_cp1)):
        assert_same_curve(straight[4:], resumed, rel=1e-5, what=f"resumed at {name}")


@pytest.mark.parametrize("sets,world,key,words", [
    (["parallel.cp=2", "model.seq_len=30"], 2, "model.seq_len", "not divisible by 2*cp = 4"),
    (["parallel.cp=3"], 4, "parallel.cp", "tp*cp*pp = 1*3*1 = 3 does not divide the world size 4"),
    (["parallel.cp=2", "model.dropout=0.1"], 2, "model.dropout", "ring attention has no attention dropout"),
    (["parallel.cp=2", "train.compile=true"], 2, "train.compile", "ring attention's exchanges run in eager layers"),
    (["parallel.cp=2", "train.cuda_graphs=true"], 2, "train.cuda_graphs", "ring attention (cp=2)"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=36"], 8, "model.seq_len",
     "36 / cp=2 = 18 is not divisible by tp=4"),
    (["parallel.cp=0"], 1, "parallel.cp", "must be >= 1"),
])
def test_what_cp_cannot_run_is_refused_in_words(sets, world, key, words):
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, BASE + sets), world)
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_cp_takes_its_share_of_the_world_and_the_plan_keeps_layers_eager():
    import torch as t

    from tessera.training.plan import make_plan
    cfg = validate(load_config(None, BASE + LLAMA + ["parallel.cp=2", "parallel.tp=2"]), 8)
    assert cfg.parallel.dp == 2
    plan = make_plan(cfg, t.device("cuda"))
    assert not plan.compiled and not plan.graphed  # ring attention runs in eager layers
