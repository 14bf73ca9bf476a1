"""Eight ranks, 3D-parallel: the layouts of an 8-GPU node train as one process does, and a
checkpoint moves between them, on 8 gloo processes (fp32).

Each family (GPT-2 with its tied embedding; Llama with GQA, RoPE, SwiGLU, an untied output
layer) trains a tiny 6-layer model through the trainer (``train``), one process for STEPS steps
and one ``run_ranks`` call of 8 ranks per family running every layout in turn, for LAYOUT_STEPS:

- tp=2 x pp=2 x dp=2 with sequence parallelism, tp=4 x dp=2, pp=4 x vpp=2 x dp=2 (interleaved
  zero-bubble: split backward, deferred weight gradients), cp=2 x tp=2 x dp=2 with sequence
  parallelism, dp=8 at zero=1 and at zero=3 (FSDP), all at zero=0 unless named:
  every step's loss and gradient norm, and the final weights (the last step's checkpoint, read
  back whole), against the one-process run (which saves every step; the schedule pinned by
  optim.decay_steps, the same for a shorter train.steps);
- a checkpoint chain through them, one hop a step, each at another zero level too: the
  tp=2 x pp=2 x dp=2 (zero=0) run's step-2 checkpoint resumed at dp=8 zero=3 for step 3, saved
  and resumed at pp=4 x vpp=2 x dp=2 (interleaved 1F1B, zero=2) for step 4, then at
  cp=2 x tp=2 x dp=2 (SP, zero=1) for step 5, then at tp=4 x dp=2 (SP) for step 6; every resumed
  step continues the one-process curve to its last step, and the weights each hop saves are
  the one-process run's at that step.

Tolerances are the layout tests': rel 1e-5 per step without TP, 1e-4 where TP splits every
matmul's sum (parity.assert_same_curve), weights within 1e-5 (1e-4 with TP) of each tensor's norm.
"""

from __future__ import annotations

import pytest
import torch

from parity import assert_same_curve
from tessera.checkpoint import dcp
from training_runs import shared_result, train_histories

pytestmark = pytest.mark.slow  # (8 processes: each family's call trains 10 runs)

STEPS, LAYOUT_STEPS, WORLD = 6, 4, 8
BASE = ["model.hidden=32", "model.layers=6", "model.seq_len=16", "model.vocab_size=64", "train.micro_batch=1",
        "train.global_batch=8", f"train.steps={STEPS}", "train.seed=3", "train.log_every=1", "data.source=synthetic",
        "optim.lr=3e-3", "optim.warmup=2", f"optim.decay_steps={STEPS}", "optim.clip_grad=0.5", "optim.eps=1e-6",
        "parallel.bucket_size=3000"]
FAMILIES = {"gpt2": ["model.heads=4"],
            # kv_heads=4: GQA (2 query heads per kv head) whose kv heads split 4 ways at tp=4
            "llama": ["model.family=llama", "model.heads=8", "model.kv_heads=4", "model.tie_embeddings=false"]}
SP = "parallel.sequence_parallel=true"
# pp=4 x vpp=2: 8 virtual stages for 6 layers, the outer ones holding the embedding or the output
# layer alone (a middle stage needs a layer)
PP4_VPP2 = ["parallel.pp=4", "parallel.vpp=2", "parallel.pp_layout=0,1,1,1,1,1,1,0"]
LAYOUTS = {
    "tp2-pp2-dp2-sp": ["parallel.tp=2", "parallel.pp=2", SP],
    "tp4-dp2": ["parallel.tp=4"],
    "pp4-vpp2-dp2": PP4_VPP2 + ["parallel.schedule=interleaved-zb"],
    "cp2-tp2-dp2-sp": ["parallel.cp=2", "parallel.tp=2", SP],
    "dp8-zero1": ["parallel.zero=1"],
    "dp8-zero3": ["parallel.zero=3"],
}
# the checkpoint chain: (name, layout, the run it resumes and the step it resumes at); each hop
# trains one step, to the step the next one resumes at (the last: to STEPS)
RESUMES = [("dp8-zero3-from-tp2-pp2-dp2", LAYOUTS["dp8-zero3"], "tp2-pp2-dp2-sp", 2),
           ("pp4-vpp2-dp2-zero2-from-dp8-zero3", PP4_VPP2 + ["parallel.schedule=interleaved", "parallel.zero=2"],
            "dp8-zero3-from-tp2-pp2-dp2", 3),
           ("cp2-tp2-dp2-zero1-from-pp4-vpp2", LAYOUTS["cp2-tp2-dp2-sp"] + ["parallel.zero=1"],
            "pp4-vpp2-dp2-zero2-from-dp8-zero3", 4),
           ("tp4-dp2-sp-from-cp2-tp2-dp2", LAYOUTS["tp4-dp2"] + [SP], "cp2-tp2-dp2-zero1-from-pp4-vpp2", 5)]
SAVES = {src: step for _, _, src, step in RESUMES}  # the runs saved mid-way (and the step)
HOPS = {name: step + 1 for name, _, _, step in RESUMES}  # the step each hop trains to
LAST = {name: LAYOUT_STEPS for name in LAYOUTS} | HOPS  # the step each 8-rank run trains to
_RESULTS: dict = {}


def _dirs(tmp, name: str) -> list[str]:
    """Where a run saves (its last step, and the step the chain's next hop resumes at; the one
    process: every step)."""
    save = ["checkpoint.save_every=1"] if name == "one" else \
        [f"checkpoint.save_every={SAVES[name]}"] if name in SAVES and name not in HOPS else []
    return [f"checkpoint.dir={tmp}/{name}", f"train.out_dir={tmp}/{name}-out", *save]


def _weights(tmp, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    return dcp.read_whole(f"{tmp}/{name}/step_{step:08d}")


def _runs(tmp, family: str) -> dict:
    """Every run's history and final weights: one process, then the 8-rank layouts and the chain."""
    base = BASE + FAMILIES[family]
    one = train_histories(1, base, [_dirs(tmp, "one")], timeout=240)[0]
    runs = [layout + _dirs(tmp, name) + [f"train.steps={LAYOUT_STEPS}"] for name, layout in LAYOUTS.items()]
    runs += [layout + _dirs(tmp, name) + [f"checkpoint.load={tmp}/{src}/step_{step:08d}", f"train.steps={step + 1}"]
             for name, layout, src, step in RESUMES]
    many = train_histories(WORLD, base, runs, timeout=600)
    names = ["one", *LAYOUTS, *(name for name, *_ in RESUMES)]
    out = {name: (h, _weights(tmp, name, LAST.get(name, STEPS))) for name, h in zip(names, [one, *many])}
    out["one-by-step"] = {step: _weights(tmp, "one", step) for step in set(LAST.values())}
    return out


def results(tmp_path_factory, family: str) -> dict:
    return shared_result(_RESULTS, family, lambda: _runs(tmp_path_factory.mktemp(f"eight-{family}"), family))


def _same_weights(got: dict, want: dict, rel: float, what: str) -> None:
    assert set(got) == set(want), what
    for name, expected in want.items():
        error = float((got[name] - expected).norm() / expected.norm().clamp(min=1e-12))
        assert error <= rel, f"{what}: {name}: relative error {error:.2e}"


def _tolerance(layout: list[str]) -> float:
    return 1e-4 if any(s.startswith("parallel.tp=") for s in layout) else 1e-5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_eight_rank_layout_trains_as_one_process(tmp_path_factory, family, layout):
    out = results(tmp_path_factory, family)
    reference, _ = out["one"]
    assert len({round(m["loss"], 6) for m in reference}) == STEPS, "every step moved the model"
    history, final = out[layout]
    rel = _tolerance(LAYOUTS[layout])
    assert [m["step"] for m in history] == list(range(1, LAYOUT_STEPS + 1)), layout
    assert_same_curve(reference[:LAYOUT_STEPS], history, rel=rel, what=f"{family} {layout}")
    _same_weights(final, out["one-by-step"][LAYOUT_STEPS], rel, f"{family} {layout}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_moves_between_eight_rank_layouts(tmp_path_factory, family):
    """tp2 x pp2 x dp2 (SP) -> dp8 zero3 -> pp4 x vpp2 x dp2 zero2 -> cp2 x tp2 x dp2 (SP) zero1 ->
    tp4 x dp2 (SP), one step on each: each resumed run's step is the one-process run's, and
    the weights it saves are the one-process run's at that step."""
    out = results(tmp_path_factory, family)
    reference, _ = out["one"]
    for name, _, _, step in RESUMES:
        history, final = out[name]
        assert [m["step"] for m in history] == [step + 1], name
        assert_same_curve(reference[step:step + 1], history, rel=1e-4, what=f"{family} {name}")
        _same_weights(final, out["one-by-step"][step + 1], 1e-4, f"{family} {name}")
    assert HOPS[RESUMES[-1][0]] == STEPS  # (the chain's last hop ends the run)
