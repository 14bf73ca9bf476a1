"""The execution plan: every "auto" resolved by one rule from the layout, model and device, explicit
choices standing, and the plan's one line at the run's start."""

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
