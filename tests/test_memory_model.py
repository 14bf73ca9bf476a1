"""The memory model (training/memory_model.py, models/activations.py) against what the trainer's
parts hold on CPU processes: the model state equals ``memory_report``'s measured bytes exactly on
every zero stage, pipeline and TP layout; the activation formulas are within 2 % of the bytes a
forward leaves alive (``kept_bytes``) for several layouts and every recompute mode; the pipeline
walk holds what the simulator says each schedule keeps in flight."""

from __future__ import annotations

import pytest
import torch

from tessera.config import load_config
from tessera.models import GPTModel
from tessera.models.activations import Activations, kept_bytes, peak_bytes
from tessera.pipeline_parallel.schedules import build_all
from tessera.pipeline_parallel.simulator import simulate
from tessera.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tessera.tensor_parallel.random import SelectivePolicy
from tessera.testing import run_ranks
from tessera.training.memory_model import chunk_parameters, model_state, predict, predict_ranks
from tessera.training.plan import make_plan
from tessera.training.preflight import validate

# odd sizes, so that padding (the vocabulary, each parameter's alignment, each bucket's dp
# multiple) and several buckets per chunk are exercised
STATE = ["model.hidden=40", "model.layers=3", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
         "train.micro_batch=1", "train.global_batch=8", "data.source=synthetic", "parallel.bucket_size=3000"]

STATE_LAYOUTS = {
    "tp2-bf16": ["parallel.tp=2", "train.dtype=bf16"],
    "pp2-tied": ["parallel.pp=2", "model.tie_embeddings=true", "parallel.pp_layout=1,2"],
    "pp2-vpp3-llama": ["parallel.pp=2", "parallel.vpp=3", "model.layers=6", "model.family=llama", "model.kv_heads=2"],
    "dp2-zero1-bf16": ["parallel.dp=2", "parallel.zero=1", "train.dtype=bf16"],
    "dp2-zero1-bf16-grads": ["parallel.dp=2", "parallel.zero=1", "train.dtype=bf16", "train.grad_dtype=bf16"],
    "dp2-zero0-bf16-grads": ["parallel.dp=2", "train.dtype=bf16", "train.grad_dtype=bf16"],
    "dp2-zero2": ["parallel.dp=2", "parallel.zero=2"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3", "train.dtype=bf16"],
    "cp2-zero1": ["parallel.cp=2", "parallel.zero=1", "model.family=llama"],
}


def _state(rank, world, runs):
    """Each layout's measured and predicted model state on this rank."""
    from tessera.distributed.memory import memory_report
    from tessera.training.build import build, build_topology

    out = {}
    for name, overrides in runs.items():
        cfg = validate(load_config(None, STATE + overrides), world)
        topo = build_topology(cfg, torch.device("cpu"))
        parts = build(cfg, topo)
        out[name] = (memory_report(parts.data_parallel, parts.optimizer),
                     model_state(cfg, topo.pp_rank, topo.dp_cp_rank))
    return out


@pytest.mark.timeout(200)
def test_the_model_state_is_the_measured_one_to_the_byte():
    for rank in run_ranks(_state, 2, STATE_LAYOUTS, timeout=180):
        for name, (measured, predicted) in rank.items():
            assert predicted == measured, (name, measured, predicted)


def test_the_parameter_table_is_the_models():
    cfg = load_config(None, STATE + ["model.family=llama", "model.kv_heads=2"]).model
    for pre, post, layers in ((True, True, range(3)), (True, False, range(1)), (False, True, range(1, 3))):
        model = GPTModel(cfg, layer_range=layers, pre_process=pre, post_process=post)
        table = chunk_parameters(cfg, 1, layers, pre, post)
        assert [(q.name, q.numel) for q in table] == [(n, p.numel()) for n, p in model.named_parameters()]


# -- activations against kept_bytes ----------------------------------------------------------------------
ACT = ["model.family=llama", "model.layers=2", "model.hidden=128", "model.heads=4", "model.kv_heads=2",
       "model.vocab_size=300", "model.seq_len=256", "train.micro_batch=2", "train.global_batch=2",
       "data.source=synthetic"]

ACT_LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2-sp-selective": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective"],
    "tp2-sp-full": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=full"],
    "tp2": ["parallel.tp=2"],
    "cp2": ["parallel.cp=2"],
    "cp2-selective": ["parallel.cp=2", "train.recompute=selective"],
    "cp2-first-layer-full": ["parallel.cp=2", "train.recompute=full", "train.recompute_layers=1"],
}


def _kept(rank, world, runs):
    """Each layout's (measured, predicted) bytes one micro-batch's forward leaves alive, the loss left out."""
    from tessera.training.build import build, build_topology
    from tessera.training.data_feed import DataFeed
    from tessera.training.memory_model import activations_for, chunk_bytes, rank_chunks

    out = {}
    for name, overrides in runs.items():
        cfg = validate(load_config(None, ACT + overrides), world)
        topo = build_topology(cfg, torch.device("cpu"))
        parts = build(cfg, topo)
        batch = DataFeed(cfg, topo).next()[0]
        box = []
        measured = kept_bytes(lambda: box.append(parts.chunks[0](tokens=batch["tokens"], labels=batch["labels"])))
        measured -= box[0].untyped_storage().nbytes()
        act = activations_for(cfg, parts.plan, "cpu")
        (stage, layers), = rank_chunks(cfg, 0)
        out[name] = (measured, chunk_bytes(cfg, act, stage, layers).held - act.tokens * 4)
    return out


@pytest.mark.slow  # (the module's quickest multi-rank test, the model state's, stays in the fast subset)
@pytest.mark.timeout(200)
def test_activation_formulas_follow_the_kept_bytes_of_tp_sp_and_cp_layouts():
    for rank in run_ranks(_kept, 2, ACT_LAYOUTS, timeout=180):
        for name, (measured, predicted) in rank.items():
            assert predicted == pytest.approx(measured, rel=0.02), (name, measured, predicted)


@pytest.mark.parametrize("dtype,family", [("bf16", "llama")] + [pytest.param(d, f, marks=pytest.mark.slow) for d, f in
                                                                  (("fp32", "gpt2"), ("bf16", "gpt2"), ("fp32", "llama"))])
def test_activation_formulas_follow_the_kept_bytes_of_each_recompute_mode(family, dtype):
    cfg = load_config(None, ACT + [f"model.family={family}", f"model.kv_heads={2 if family == 'llama' else 0}",
                                   f"train.dtype={dtype}"]).model
    tokens = torch.randint(0, 300, (2, 257), generator=torch.Generator().manual_seed(0))
    act = Activations(cfg, micro_batch=2, dtype=dtype, device="cpu", fused_cross_entropy=False)
    for mode in ("none", "selective", "full"):
        model = GPTModel(cfg).to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
        model.init_weights(1)
        if mode != "none":
            model.recompute_layers = cfg.layers
            model.recompute_policy = SelectivePolicy() if mode == "selective" else None
        box = []
        measured = kept_bytes(lambda: box.append(model(tokens[:, :-1], tokens[:, 1:])))
        measured -= box[0].untyped_storage().nbytes()
        predicted = cfg.layers * act.layer_total(mode) + act.embedding() + act.head() - act.tokens * 4
        assert predicted == pytest.approx(measured, rel=0.02), (mode, measured, predicted)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_loss_holds_its_keep_and_one_logits_sized_transient(dtype):
    """The reference loss (a CPU's) at its peak: the fp32 softmax it keeps (``head``) and one
    logits-sized tensor in the dtype (``logits_transient``): the logits beside their fp32 copy in
    the forward, the gradient beside the softmax in the backward. Counting the logits twice over
    predicted 1.5x the transient."""
    cfg = load_config(None, ACT + ["model.seq_len=512", "model.vocab_size=1024"]).model
    act = Activations(cfg, micro_batch=1, dtype=dtype, device="cpu", fused_cross_entropy=False)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(act.tokens, 1, 8, dtype=torch_dtype, requires_grad=True)
    weight = torch.randn(cfg.vocab_size, 8, dtype=torch_dtype, requires_grad=True)
    target = torch.randint(0, cfg.vocab_size, (act.tokens, 1), generator=torch.Generator().manual_seed(0))

    def loss_step():
        loss = vocab_parallel_cross_entropy(x @ weight.t(), target, None, cfg.vocab_size, fused=False)
        loss.sum().backward()

    measured = peak_bytes(loss_step)
    keep = act.tokens * cfg.vocab_size * 4  # the softmax, the part of ``head`` the loss keeps
    assert measured == pytest.approx(keep + act.logits_transient(), rel=0.02), (measured, keep, act.logits_transient())


# -- the pipeline walk --------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2),
                                          ("interleaved-zb", 2)])
def test_the_pipeline_walk_holds_what_the_simulator_keeps_in_flight(schedule, vpp):
    cfg = validate(load_config(None, STATE + ["parallel.pp=4", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}",
                                              "model.layers=8", "train.global_batch=8"]), 4)
    plan = make_plan(cfg, torch.device("cuda"))
    timeline = simulate(build_all(schedule, 4, vpp, 8), vpp)
    predictions = predict_ranks(cfg, plan)
    assert [x.in_flight for x in predictions] == [timeline.peak_in_flight(r) for r in range(4)]
    if schedule == "1f1b":
        assert [x.in_flight for x in predictions] == [4, 3, 2, 1]
    if schedule in ("zb-h1", "interleaved-zb"):  # deferred W's keep something beyond the plain order's
        plain = predict(cfg, make_plan(validate(load_config(None, STATE + [
            "parallel.pp=4", f"parallel.vpp={vpp}", f"parallel.schedule={'1f1b' if vpp == 1 else 'interleaved'}",
            "model.layers=8"]), 4), torch.device("cuda")), 3)
        assert predictions[3].activations > plain.activations


def test_recomputation_and_micro_batches_move_the_predicted_peak():
    """More micro-batch tokens hold more; selective less than none, full less than selective."""
    base = ["model.hidden=1024", "model.layers=8", "model.heads=16", "model.seq_len=2048", "model.vocab_size=32000",
            "train.global_batch=8", "train.dtype=bf16", "parallel.pp=2"]
    peaks = {}
    for recompute in ("none", "selective", "full"):
        for mb in (1, 4):
            cfg = validate(load_config(None, base + [f"train.recompute={recompute}", f"train.micro_batch={mb}"]), 2)
            peaks[recompute, mb] = max(x.total for x in predict_ranks(cfg, make_plan(cfg, torch.device("cuda"))))
    for recompute in ("none", "selective", "full"):
        assert peaks[recompute, 4] > peaks[recompute, 1]
    for mb in (1, 4):
        assert peaks["none", mb] > peaks["selective", mb] > peaks["full", mb]


def test_the_fp8_weight_cache_adds_a_byte_per_linear_weight_element():
    """Tensorwise fp8 in eager layers holds each linear weight's fp8 copy for the step: the
    predicted peak exceeds the same plan without the cache by one byte per element of the QKV,
    projection and MLP weights (counted from the built model)."""
    import dataclasses

    cfg = validate(load_config(None, ["model.hidden=256", "model.layers=3", "model.heads=4", "model.seq_len=128",
                                      "model.vocab_size=512", "train.global_batch=4", "train.dtype=bf16",
                                      "train.fp8=tensorwise", "train.compile=false"]), 1)
    plan = make_plan(cfg, torch.device("cuda"))
    assert plan.fp8_weight_cache and not plan.compiled
    without = dataclasses.replace(plan, fp8_weight_cache=False)
    model = GPTModel(cfg.model, device="meta")
    linear = sum(p.numel() for n, p in model.named_parameters()
                 if n.endswith((".qkv.weight", ".proj.weight", ".fc1.weight", ".fc2.weight")))
    assert linear == 3 * (256 * 768 + 256 * 256 + 2 * 256 * 1024)
    assert predict(cfg, plan).total - predict(cfg, without).total == linear
