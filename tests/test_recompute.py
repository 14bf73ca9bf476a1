"""Activation recomputation (train.recompute): a recomputed layer keeps only its input (full), or
its input and its GEMMs' and attention's outputs (selective), and runs again in the backward; the
losses, gradient norms and final weights equal those of a run without it, to the bit: with dropout
on TP-split activations under SP (the tracker's streams put back for the rerun), with fp8 GEMMs,
in pipelines whose backward is split (zero-bubble's deferred weight gradients), under FSDP, with
context parallelism, and for the first N layers of each chunk only."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, load_config
from tessera.models import GPTModel
from tessera.tensor_parallel.random import SelectivePolicy
from tessera.models.activations import kept_bytes
from tessera.testing import run_ranks
from tessera.training.preflight import validate

BASE = ["model.hidden=32", "model.layers=4", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=1", "train.global_batch=8", "train.seed=5", "train.steps=3", "train.log_every=1",
        "data.source=synthetic", "optim.lr=1e-2", "model.dropout=0.2"]

RECOMPUTE = {"plain": [], "full": ["train.recompute=full"], "selective": ["train.recompute=selective"],
             "selective-first1": ["train.recompute=selective", "train.recompute_layers=1"]}

# world size, topology sizes, overrides (on training_runs.BASE: 2 layers unless given: one more
# than selective-first1 recomputes; a pipeline stage needs 2 per model chunk for that)
LAYOUTS = {
    "tp2-sp-dropout": (2, dict(tp=2), ["parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.2"]),
    "pp2-zb-h1": (2, dict(pp=2), ["parallel.pp=2", "parallel.schedule=zb-h1", "model.layers=4"]),
    "pp2-vpp2-interleaved-zb": (2, dict(pp=2), ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-zb",
                                                "model.layers=8"]),
    "dp2-fsdp": (2, dict(dp=2), ["parallel.dp=2", "parallel.zero=3"]),
    "tp2-sp-fp8": (2, dict(tp=2), ["parallel.tp=2", "parallel.sequence_parallel=true", "train.fp8=tensorwise",
                                   "model.family=llama"]),
}


def _runs(rank, world, sizes, layout):
    """Each recompute mode's training_runs.train_run on ``layout`` (3 steps: each step's figures
    and the final weights to the bit, a step's recomputation needing nothing of the steps
    before), and how many layer forwards this rank recomputed."""
    from training_runs import train_run

    from tessera.models import gpt
    from tessera.topology import Topology

    topo = Topology.build(**sizes)
    calls, real = [], gpt.recompute

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    gpt.recompute = counted
    out = {}
    for name, extra in RECOMPUTE.items():
        calls.clear()
        run = train_run(topo, layout + extra, steps=3)
        out[name] = dict(losses=run["losses"], norms=run["norms"], params=run["params"], recomputed=len(calls))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name if name == "pp2-zb-h1" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in LAYOUTS])
def test_recomputed_layers_give_the_same_run_to_the_bit(name):
    world, sizes, layout = LAYOUTS[name]
    by_rank = run_ranks(_runs, world, sizes, layout, timeout=280)
    for rank in by_rank:
        plain = rank["plain"]
        for mode in RECOMPUTE:
            run = rank[mode]
            assert run["losses"] == plain["losses"] and run["norms"] == plain["norms"], (mode, run, plain)
            for key, p in plain["params"].items():
                assert torch.equal(run["params"][key], p), (mode, key)
        counts = {mode: rank[mode]["recomputed"] for mode in RECOMPUTE}
        assert counts["plain"] == 0 and counts["full"] == counts["selective"] > counts["selective-first1"] > 0, counts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recomputed_layers_under_context_parallelism_give_the_same_run_to_the_bit(tmp_path):
    """cp=2 (ring attention, whose blocks selective recomputation does not keep): the trainer's
    losses and gradient norms (the weights: test_context_parallel.py, against one process)."""
    from training_runs import train_histories

    runs = [["parallel.cp=2", "model.family=llama", "model.kv_heads=2", "model.dropout=0",
             f"train.out_dir={tmp_path}/{name}", *extra] for name, extra in RECOMPUTE.items()]
    histories = train_histories(2, BASE, runs, timeout=280)
    curves = [[(m["loss"], m["grad_norm"]) for m in h] for h in histories]
    assert len(curves[0]) == 3 and all(c == curves[0] for c in curves), curves


def _kept(model: GPTModel, tokens: torch.Tensor) -> int:
    """Bytes one forward keeps for the backward (the loss left out); the backward is run too."""
    box = []
    kept = kept_bytes(lambda: box.append(model(tokens[:, :-1], tokens[:, 1:])))
    loss = box.pop()
    kept -= loss.untyped_storage().nbytes()
    loss.sum().backward()
    return kept


@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_selective_keeps_less_than_none_and_more_than_full(family):
    """The same gradients from all three modes; what the forward keeps: none > selective > full."""
    cfg = ModelConfig(family=family, hidden=64, layers=4, heads=4, seq_len=64, vocab_size=50)
    tokens = torch.randint(0, 50, (4, 65), generator=torch.Generator().manual_seed(0))
    kept, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = GPTModel(cfg)
        model.init_weights(1)
        if mode != "none":
            model.recompute_layers = 4
            model.recompute_policy = SelectivePolicy() if mode == "selective" else None
        kept[mode] = _kept(model, tokens)
        grads[mode] = [p.grad for p in model.parameters()]
    assert kept["full"] < 0.2 * kept["none"] and 0.4 * kept["none"] < kept["selective"] < 0.8 * kept["none"], kept
    for mode in ("selective", "full"):
        assert all(torch.equal(g, h) for g, h in zip(grads[mode], grads["none"])), mode


def test_combinations_it_does_not_run_are_refused():
    for extra, key in [(["train.recompute_layers=2"], "train.recompute_layers"),
                       (["train.recompute=selective", "train.compile=true"], "train.compile"),
                       (["train.recompute=full", "train.recompute_layers=-1"], "train.recompute_layers")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, BASE + extra)
    for mode in ("full", "selective"):
        with pytest.raises(ConfigError, match=r"train\.cuda_graphs: a graphed layer's backward"):
            validate(load_config(None, BASE + ["model.dropout=0", f"train.recompute={mode}",
                                               "train.cuda_graphs=true"]), 1)


def _compiled_runs() -> tuple[dict, dict, int]:
    from training_runs import train_run

    from tessera.models import gpt
    from tessera.topology import Topology

    calls, real = [], gpt.recompute
    gpt.recompute = lambda *args, **kw: (calls.append(1), real(*args, **kw))[1]
    try:
        sets = ["model.family=llama", "model.kv_heads=1", "model.dropout=0.1", "optim.lr=1e-3", "train.compile=true"]
        plain = train_run(Topology.build(), sets, steps=3)
        recomputed = train_run(Topology.build(), sets + ["train.recompute=full"], steps=3)
    finally:
        gpt.recompute = real
    return plain, recomputed, len(calls)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_layers_recomputed_whole_give_the_same_run_to_the_bit():
    """train.compile=true with train.recompute=full (llama, dropout 0.1, inductor's CPU backend):
    every layer of every micro-batch goes through the recompute node and runs compiled again in
    the backward, with no graph break; losses, gradient norms and final weights equal the compiled
    run without recomputation to the bit (the restored generator gives inductor's dropout the same
    seeds)."""
    plain, recomputed, calls = _compiled_runs()
    assert calls == 2 * 8 * len(plain["losses"])  # layers x micro-batches x steps
    assert plain["graph_breaks"] == recomputed["graph_breaks"] == 0
    assert recomputed["losses"] == plain["losses"] and recomputed["norms"] == plain["norms"]
    assert all(torch.equal(recomputed["params"][name], p) for name, p in plain["params"].items())


def _block(w: torch.Tensor, tracker):
    """A layer in miniature: a GEMM, dropout on the default stream and on the tracker's tp stream."""
    def fn(x, scale):
        h = torch.nn.functional.dropout(x @ w, 0.3)
        with tracker.fork("tp"):
            h = torch.nn.functional.dropout(h, 0.3)
        return torch.tanh(h) * scale
    return fn


@pytest.mark.parametrize("input_grad", [True, False])
def test_the_recompute_node_gives_the_plain_gradients_masks_and_later_draws(input_grad):
    """Full recomputation (one autograd node where x needs a gradient; torch's checkpoint where it
    does not): the output, x's and the weight's gradients equal the plain run's to the bit, every
    dropout mask recomputed as drawn, and both streams left where the plain run leaves them."""
    from tessera.tensor_parallel.random import RNGTracker, recompute

    def run(recomputed: bool):
        torch.manual_seed(0)
        tracker = RNGTracker("cpu")
        tracker.add("tp", 7)
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)).requires_grad_(input_grad)
        fn = _block(w, tracker)
        y = recompute(fn, x, 0.5, tracker=tracker) if recomputed else fn(x, 0.5)
        torch.randn(3)  # a draw between forward and backward: the rerun must not see it
        y.square().sum().backward()
        with tracker.fork("tp"):
            after_tp = torch.rand(2)
        return y.detach(), w.grad, x.grad, torch.rand(2), after_tp

    for a, b in zip(run(False), run(True)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_recompute_refuses_a_second_input_that_needs_a_gradient():
    from tessera.tensor_parallel.random import recompute

    x, other = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="first argument alone"):
        recompute(lambda a, b: a * b, x, other)
