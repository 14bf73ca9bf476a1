"""Activation recomputation (train.recompute): a recomputed layer keeps only its input and runs
again in the backward; the run's losses and gradient norms equal those of a run without it, to
the bit, with dropout on TP-split activations (the tracker's streams put back for the rerun), in
pipelines with a split backward, under FSDP, and for the first N layers of each chunk only."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, load_config
from tessera.models import GPTModel
from tessera.testing import run_ranks
from tessera.training.preflight import validate

BASE = ["model.hidden=32", "model.layers=4", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=1", "train.global_batch=8", "train.seed=5", "train.steps=3", "train.log_every=1",
        "data.source=synthetic", "optim.lr=1e-2", "model.dropout=0.2"]


def _runs(rank, world, runs):
    """Each run's (loss, grad norm) per step on the logging rank (None elsewhere), and how many
    layer forwards this rank recomputed."""
    from tessera.models import gpt
    from tessera.training.trainer import train

    calls, real = [], gpt.recompute

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    gpt.recompute = counted
    out = []
    for run in runs:
        calls.clear()
        history = train(load_config(None, BASE + run))
        out.append(([(m["loss"], m["grad_norm"]) for m in history] or None, len(calls)))
    return out


LAYOUTS = {
    "tp2-sp-dropout": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2-zb-h1": (2, ["parallel.pp=2", "parallel.schedule=zb-h1"]),
    "dp2-fsdp": (2, ["parallel.dp=2", "parallel.zero=3"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name if name == "pp2-zb-h1" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in LAYOUTS])
def test_recomputed_layers_give_the_same_run_to_the_bit(tmp_path, name):
    world, layout = LAYOUTS[name]
    runs = [layout + [f"train.out_dir={tmp_path}/{what}", *extra] for what, extra in
            (("plain", []), ("full", ["train.recompute=full"]), ("first1", ["train.recompute=full", "train.recompute_layers=1"]))]
    by_rank = run_ranks(_runs, world, runs, timeout=280)
    plain, full, first = (next(r[i][0] for r in by_rank if r[i][0] is not None) for i in range(3))
    assert len(plain) == 3 and full == plain and first == plain, (plain, full, first)
    recomputed = [[r[i][1] for r in by_rank] for i in range(3)]
    assert sum(recomputed[0]) == 0 and sum(recomputed[2]) < sum(recomputed[1]), recomputed
    assert all(n > 0 for n in recomputed[2]), recomputed  # every rank recomputed some of its layers


def _saved_bytes(model: GPTModel, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from one forward for the backward."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    return sum(seen.values())


def test_a_recomputed_layer_keeps_only_its_input():
    """The forward of 4 recomputed layers keeps a fraction of what the plain one keeps; the
    gradients are the same."""
    cfg = ModelConfig(hidden=64, layers=4, heads=4, seq_len=64, vocab_size=50)
    tokens = torch.randint(0, 50, (4, 65), generator=torch.Generator().manual_seed(0))
    plain, again = GPTModel(cfg), GPTModel(cfg)
    plain.init_weights(1)
    again.init_weights(1)
    again.recompute_layers = 4
    kept, kept_again = _saved_bytes(plain, tokens), _saved_bytes(again, tokens)
    assert kept_again < 0.4 * kept, (kept_again, kept)
    for p, q in zip(plain.parameters(), again.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_combinations_it_does_not_run_are_refused():
    for extra, key in [(["train.recompute_layers=2"], "train.recompute_layers"),
                       (["train.recompute=full", "train.compile=true"], "train.compile"),
                       (["train.recompute=full", "train.recompute_layers=-1"], "train.recompute_layers")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, BASE + extra)
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs: a graphed layer's backward"):
        validate(load_config(None, BASE + ["model.dropout=0", "train.recompute=full", "train.cuda_graphs=true"]), 1)
