"""The execution plan: every "auto" resolved by one rule from the layout, model and device, explicit
choices standing, and the plan's one line at the run's start."""

import pytest
import torch

from tessera.config import load_config
from tessera.training.plan import choose_schedule, make_plan
from tessera.training.preflight import validate

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _plan(sets, device=CUDA):
    cfg = load_config(None, sets)
    p = cfg.parallel
    return make_plan(validate(cfg, p.tp * p.pp * max(p.dp, 1)), device)


def _resolved(sets, device=CUDA):
    """(compiled layers, fused weight gradients, CUDA-graphed layers)."""
    plan = _plan(sets, device)
    return plan.compiled, plan.fuse_wgrad, plan.graphed


def test_auto_schedule_is_the_fastest_valid_one():
    assert choose_schedule("auto", 1, 1, 4) == "none"
    assert choose_schedule("auto", 2, 2, 4) == "interleaved-zb"  # measured faster than interleaved
    assert choose_schedule("auto", 2, 2, 4, zero=2) == "interleaved"  # zero=2 reduces before the deferred W's
    assert choose_schedule("auto", 2, 1, 8, zero=2) == "1f1b"
    assert choose_schedule("auto", 4, 1, 8) == "zb-h1"
    assert choose_schedule("1f1b", 4, 1, 8) == "1f1b"


def test_tp1_compiles_llama_layers_and_fuses_weight_gradients():
    assert _resolved([]) == (False, True, False)  # GPT at tp=1: fused weight gradients, eager layers
    assert _resolved(["model.family=llama"]) == (True, True, False)  # llama: compiled layers, fused W inside
    assert _resolved(["model.family=llama", "parallel.schedule=1f1b"]) == (True, True, False)
    assert _resolved(["model.family=llama", "parallel.dp=2", "parallel.zero=1"]) == (True, True, False)
    assert _resolved(["model.family=llama", "parallel.dp=2", "parallel.zero=3"]) == (True, False, False)  # FSDP
    # around deferred weight gradients: eager layers (with the compiled elementwise functions)
    plan = _plan(["model.family=llama", "parallel.pp=2"])
    assert plan.schedule == "zb-h1" and (plan.compiled, plan.fuse_wgrad, plan.fused_elementwise) == (False, True, True)
    assert _resolved(["model.family=llama", "train.recompute=full"]) == (False, True, False)  # recomputed: eager
    assert _resolved(["parallel.dp=2"]) == (False, True, False)
    assert _resolved(["parallel.pp=2"]) == (False, True, False)
    assert _resolved(["parallel.dp=2", "parallel.zero=3"]) == (False, False, False)


def test_tp2_graphs_the_layers_where_they_can_be_captured():
    assert _resolved(["parallel.tp=2"]) == (False, False, True)
    assert _resolved(["parallel.tp=2", "parallel.sequence_parallel=true", "model.family=llama"]) == (False, False, True)
    assert _resolved(["parallel.tp=2", "model.dropout=0.1"]) == (False, False, False)  # not capturable: eager
    assert _resolved(["parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b"]) == (False, False, False)
    # under zero 1/2's overlapped gather (its hooks lifted for the capture)
    assert _resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=1"]) == (False, False, True)
    assert _resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=2"]) == (False, False, True)
    assert _resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=3"]) == (False, False, False)  # FSDP's hooks
    assert _resolved(["parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "parallel.overlap_param_gather=false"]) \
        == (False, False, True)
    assert _resolved(["parallel.tp=2", "train.cuda_graphs=false"]) == (False, False, False)
    assert _resolved(["parallel.tp=2", "train.compile=true"]) == (True, False, False)


def test_explicit_choices_stand():
    assert _resolved(["parallel.tp=2", "train.grad_accum_fusion=true"]) == (False, True, True)  # captured in graphs
    assert _resolved(["train.cuda_graphs=true", "train.grad_accum_fusion=true"]) == (False, True, True)
    assert _resolved(["parallel.tp=2", "train.grad_accum_fusion=true", "parallel.zero=2"]) == (False, True, False)
    assert _resolved(["model.family=llama", "train.grad_accum_fusion=false"]) == (True, False, False)
    assert _resolved(["train.compile=true"]) == (True, False, False)  # GPT: fusion only where auto compiled
    assert _resolved(["train.compile=true", "train.grad_accum_fusion=true"]) == (True, True, False)
    assert _resolved(["train.compile=false", "train.grad_accum_fusion=false"]) == (False, False, False)
    assert _resolved(["train.cuda_graphs=true"]) == (False, False, True)
    assert _resolved(["train.cuda_graphs=true", "model.family=llama"]) == (False, False, True)
    assert _plan(["model.family=llama", "parallel.pp=2", "train.fused_elementwise=false"]).fused_elementwise is False


def test_nothing_fast_on_a_cpu_unless_asked():
    for sets in ([], ["parallel.tp=2"], ["model.family=llama"], ["model.family=llama", "parallel.pp=2"]):
        plan = _plan(sets, CPU)
        assert (plan.compiled, plan.fuse_wgrad, plan.graphed, plan.fused_elementwise, plan.fused_cross_entropy) \
            == (False,) * 5, sets
    assert _resolved(["train.compile=true", "train.grad_accum_fusion=true"], CPU) == (True, True, False)


def test_tp_backward_overlap_is_on_inside_graphs_only():
    for sets, device, on in ((["parallel.tp=2"], CUDA, True), (["parallel.tp=2"], CPU, False),
                             (["parallel.tp=2", "train.cuda_graphs=false"], CUDA, False),
                             (["parallel.tp=2", "train.compile=true"], CUDA, False), ([], CUDA, False),
                             (["parallel.tp=2", "parallel.tp_comm_overlap=true"], CPU, True),
                             (["parallel.tp=2", "parallel.tp_comm_overlap=false"], CUDA, False)):
        assert _plan(sets, device).comm_overlap is on, (sets, device)


def test_layout_and_the_plan_line():
    cfg = validate(load_config(None, ["parallel.pp=2", "parallel.vpp=2", "model.layers=8", "model.family=llama",
                                      "model.vocab_size=32000"]), 2)
    plan = make_plan(cfg, CUDA)
    assert plan.schedule == "interleaved-zb" and plan.split_backward
    assert sum(plan.layout) == 8 and len(plan.layout) == 4 and plan.layout[-1] < plan.layout[0]  # the head counted
    line = plan.describe(cfg)
    assert line.startswith("schedule interleaved-zb, layers per stage [") and "pp_layout=auto" in line
    assert "weight gradients fused into main_grad (deferred, interleaved-zb)" in line
    assert "RMSNorm / RoPE / SwiGLU compiled" in line
    even = make_plan(validate(load_config(None, ["parallel.pp=2", "model.layers=8"]), 2), CPU)
    assert even.layout == (4, 4) and even.describe(load_config(None, [])).endswith("weight gradients via autograd (deferred, zb-h1)")


# -- tessera plan: the layouts that fit, ranked, and why the others do not ------------------------------------
TINY = ["model.family=gpt2", "model.vocab_size=256", "model.hidden=64", "model.layers=4", "model.heads=4",
        "model.seq_len=64", "train.global_batch=8", "train.micro_batch=1", "train.dtype=bf16"]


def _verdicts(gpus=4, memory=2**40, sets=()):
    from tessera.training.planner import Machine, plan

    base = load_config(None, TINY + list(sets))
    machine = Machine(gpus=gpus, memory=memory)
    return base, machine, plan(base, machine)


def test_every_listed_layout_passes_the_preflight_and_its_peak_fits():
    from tessera.training.planner import render
    from tessera.training.preflight import check_pipeline

    base, machine, verdicts = _verdicts(memory=3 * 2**20)
    fits = [v for v in verdicts if v.fits]
    assert 0 < len(fits) < len([v for v in verdicts if v.refused is None])  # some fit, some over memory
    for v in fits:
        cfg = validate(v.layout.config(base), 4)
        check_pipeline(cfg)
        assert v.peak.total <= machine.usable and v.step_time > 0
    fit_part = render(base, machine, verdicts, top=len(fits)).split("do not fit")[0]
    assert all(_row(v.layout) in fit_part for v in fits) and "slower" not in fit_part


def _row(lay) -> str:
    return (f"{lay.tp:>2} {lay.pp:>2} {lay.vpp:>3} {lay.cp:>2} {lay.dp:>3} {lay.zero:>4} {lay.recompute:<9} "
            f"{lay.micro_batch:>3} {'yes' if lay.offload else 'no':>7} ")


def test_a_layout_over_memory_is_not_listed_and_its_reason_is_given():
    from tessera.training.planner import describe, render

    base, machine, verdicts = _verdicts(memory=3 * 2**20)
    over = [v for v in verdicts if v.refused is None and not v.fits]
    assert over and all(v.peak.total > machine.usable for v in over)
    text = render(base, machine, verdicts, top=10**6, every=True)
    fit_part, reasons = text.split("do not fit")
    hungriest = max(over, key=lambda v: v.peak.total)
    lay = hungriest.layout
    assert _row(lay) not in fit_part
    assert f"      {lay}: {hungriest.peak.total / 2**20:.1f} MiB > 2.7 (state " in reasons
    group = [v.layout for v in over if (v.layout.tp, v.layout.pp, v.layout.vpp, v.layout.cp, v.layout.dp,
                                        v.layout.zero) == (lay.tp, lay.pp, lay.vpp, lay.cp, lay.dp, lay.zero)]
    assert f"    {describe(group)}: {len(group)} layout" in reasons  # its group's one line
    assert "refused by the preflight" in reasons and "parallel.vpp: pp*vpp = 8 virtual stages" in reasons


@pytest.mark.slow
def test_more_memory_never_removes_a_layout():
    fitting = []
    for memory in (2 * 2**20, 3 * 2**20, 5 * 2**20, 2**40):
        fitting.append({v.layout for v in _verdicts(memory=memory)[2] if v.fits})
    assert all(a <= b for a, b in zip(fitting, fitting[1:])) and fitting[0] < fitting[-1]


def test_pure_data_parallelism_halves_the_compute_per_rank_with_twice_the_gpus():
    from tessera.training.planner import Layout, Machine, check, step_time

    from pathlib import Path

    base = load_config(str(Path(__file__).parents[1] / "benchmarks/models/gpt-1.3b.toml"), [])
    times = []
    for dp in (1, 2, 4):
        cfg, plan = check(Layout(1, 1, 1, 1, dp, 0, "none", 1), base, dp)
        times.append(step_time(cfg, plan, Machine(gpus=dp, memory=2**40)))
    for a, b in zip(times, times[1:]):
        assert abs(b["compute"] / a["compute"] - 0.5) < 1e-9
        assert b["step"] < a["step"]  # (GPT-1.3B: the gradient all-reduce hides behind the backward)


def test_recomputation_trades_memory_for_time_in_the_ranking():
    from tessera.training.planner import Layout

    verdicts = _verdicts(gpus=1)[2]
    by_layout = {v.layout: v for v in verdicts if v.fits}

    none, full = (by_layout[Layout(1, 1, 1, 1, 1, 0, mode, 1)] for mode in ("none", "full"))
    assert full.peak.activations < none.peak.activations and full.step_time > none.step_time


def test_bad_input_is_refused_in_words(capsys, tmp_path):
    import pytest

    from tessera.cli import main
    from tessera.config import ConfigError

    config = tmp_path / "tiny.toml"
    config.write_text("[model]\nfamily = 'gpt2'\nvocab_size = 256\nhidden = 64\nlayers = 4\nheads = 4\nseq_len = 64\n"
                      "[train]\nglobal_batch = 8\nmicro_batch = 1\n")
    assert main(["plan", "--config", str(config), "--gpus", "2", "--gpu-memory", "abc"]) == 2
    assert "'abc' is not an amount of memory: give a number and a unit, e.g. 80GB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(config), "--gpus", "0", "--gpu-memory", "80GB"])
    assert "argument --gpus: must be an integer > 0, got 0" in capsys.readouterr().err
    assert main(["plan", "--config", str(config), "--gpus", "2", "--gpu-memory", "1MB"]) == 1
    out = capsys.readouterr()
    assert "no layout fits 0.9 MiB per GPU" in out.out and "over memory" in out.out
    assert "no layout of 2 GPUs fits" in out.err and "-> give more GPUs (--gpus), a larger --gpu-memory" in out.err
    assert main(["plan", "--config", str(config), "--gpus", "2", "--gpu-memory", "80GB", "--headroom", "1"]) == 2
    assert "--headroom 1.0 leaves no memory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no layout of 3 GPUs runs this config"):
        _verdicts(gpus=3)
    assert main(["plan", "--config", str(config), "--gpus", "4", "--gpu-memory", "80GB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fit (" in out and "fastest first" in out and "  ... and " in out


def test_offload_moves_the_optimizer_to_the_host_and_ranks_after_the_same_layout_without():
    from tessera.training.planner import Layout

    base, machine, verdicts = _verdicts(gpus=2)
    by_layout = {v.layout: v for v in verdicts}
    for zero in (0, 1, 2):
        off, on = (by_layout[Layout(1, 1, 1, 1, 2, zero, "none", 1, offload)] for offload in (False, True))
        assert on.fits and off.fits and on.peak.state.host > 0 and off.peak.state.host == 0
        assert on.peak.state.total == off.peak.state.total - off.peak.state.main_params - off.peak.state.optimizer_state
        assert on.parts["offload"] > 0 and on.step_time > off.step_time
    assert not any(v.layout.offload and v.layout.zero == 3 for v in verdicts)
    # a memory between the two: only offload fits
    off, on = (by_layout[Layout(1, 1, 1, 1, 2, 0, "full", 1, offload)] for offload in (False, True))
    squeezed = _verdicts(gpus=2, memory=int((on.peak.total + off.peak.total) / 2 / 0.9))[2]
    fitting = {v.layout for v in squeezed if v.fits}
    assert on.layout in fitting and off.layout not in fitting


def test_heterogeneous_stages_plan_for_their_own_tp():
    """parallel.tp stays 1 under stage lists: each rank plans for its stage's tp (the trainer passes
    ``topo.tp``), and without one the largest stage's, never tp=1 choices for a tp=2 stage."""
    cfg = validate(load_config(None, ["model.family=llama", "parallel.pp=2", "parallel.stage_tp=1,2",
                                      "parallel.stage_dp=2,1", "parallel.schedule=1f1b",
                                      "model.tie_embeddings=false"]), 4)
    assert cfg.parallel.tp == 1
    one, two, default = (make_plan(cfg, CUDA, tp) for tp in (1, 2, None))
    assert (one.compiled, one.fuse_wgrad) == (True, True)  # the tp=1 stage: llama compiled, fused W
    assert (two.compiled, two.fuse_wgrad, two.graphed) == (False, False, False)  # tp=2 (no graphs at pp > 1)
    assert default == two


def test_the_rules_follow_the_layers_kind_and_layout_not_the_shape():
    """Every shape of benchmarks/sweep.py (sequence 2k-16k, head dim 64 / 128, GQA 1-8, vocabulary
    32k-152k, hidden 2048-4096, micro-batch 1-4) resolves alike at tp=1: compiled layers with fused
    weight gradients and the fused loss, no graphs. The same sizes with GPT-2's layers (LayerNorm
    and GELU, each one kernel eagerly) keep eager layers with fused weight gradients, fp8 ones
    compile; at tp=2 every shape's eager layers are graphed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from sweep import SHAPES, STEPS

    for shape in SHAPES:
        sets = ["model.family=llama", *shape.tessera_overrides(STEPS)]
        plan = _plan(sets)
        assert (plan.compiled, plan.fuse_wgrad, plan.graphed, plan.fused_cross_entropy) == (True, True, False, True)
        gpt2 = [s for s in sets if not s.startswith(("model.family", "model.kv_heads", "model.ffn_hidden"))]
        assert _resolved(gpt2) == (False, True, False), shape.name
        assert _resolved(gpt2 + ["train.fp8=tensorwise"]) == (True, True, False), shape.name
        tp2 = sets + ["parallel.tp=2", "parallel.sequence_parallel=true"]
        assert _resolved(tp2) == (False, False, True), shape.name
