"""The whole model at tp=2 and tp=4 equals the tp=1 model built from the same seed.

For GPT-2 and Llama (grouped-query attention), tied and untied embeddings, with and without
sequence parallelism: the initial weights (gathered from the shards), the logits, the per-token
loss and every parameter's gradient. The tp=1 reference is computed in this (the parent) process,
without any process group.

Mapping a rank's shard to the slice of the full tensor:

- ColumnParallelLinear (weight and bias): each logical sub-matrix (``output_sizes``: Q, K, V or
  gate, up) is chunked over TP along dim 0 and the local tensor is the concatenation of the
  local chunks;
- RowParallelLinear weight: chunked along dim 1; its bias is replicated;
- VocabParallelEmbedding and the output layer: rows of the padded vocabulary chunked along
  dim 0; the padding depends on tp, so only the first ``vocab_size`` rows are compared and the
  padding rows must be zero (weights and gradients);
- everything else is replicated. Under sequence parallelism parameters tagged
  ``sequence_parallel`` hold partial gradients that are all-reduced over TP before comparing.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tessera.config import ModelConfig
from tessera.models import GPTModel, TPContext
from tessera.tensor_parallel.random import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology

from parity import assert_close, compare_to_full, param_kind

SEED = 1234
VOCAB = 100  # not a multiple of tp * vocab_pad_multiple for any tp here
SEQ, BATCH = 16, 2
# fp32 tolerances. Summation order differs between layouts (TP partial sums, all-reduces), which
# costs a few ulp of the *largest* terms: the worst observed difference is ~1.2e-6 of a tensor's
# largest magnitude (logits ~3, summed-loss gradients up to ~9). So the absolute tolerance is
# relative to that scale: ATOL_REL * max|expected| (but at least ATOL).

# (family, tie_embeddings, sequence_parallel, vocab_pad_multiple)
CASES = [(family, tie, sp, 8) for family in ("gpt2", "llama") for tie in (True, False) for sp in (False, True)]
# With a pad multiple of 64 the padded vocabulary at tp=4 is 256: TP ranks 2 and 3 own only padding.
CASES += [("gpt2", True, False, 64), ("llama", False, True, 64)]


def make_cfg(family: str, tie: bool, pad: int, tp: int, **extra) -> ModelConfig:
    common = dict(vocab_size=VOCAB, vocab_pad_multiple=pad, hidden=64, layers=2, seq_len=SEQ,
                  tie_embeddings=tie, init_std=0.1)
    common.update(extra)
    if family == "gpt2":
        return ModelConfig(family="gpt2", heads=4, **common)
    # Grouped-query attention with kv_heads < heads, kv_heads divisible by tp.
    heads, kv_heads = (4, 2) if tp <= 2 else (8, 4)
    return ModelConfig(family="llama", heads=heads, kv_heads=kv_heads, **common)


def make_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tokens[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // 2, VOCAB - 2])  # ids owned by first and last ranks
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[1, :3] = torch.tensor([VOCAB - 1, 0, 63])
    weights = torch.rand(BATCH, SEQ, generator=g) + 0.5  # d(sum(w * loss)): a non-uniform upstream grad
    return tokens, labels, weights


def compare_full(ref: GPTModel, ref_values: dict[str, torch.Tensor], per_rank: list[dict[str, torch.Tensor]],
                 what: str, exact: bool) -> None:
    """Compare the shards of every parameter (``per_rank[r][name]``) with the full reference."""
    names = list(ref_values)
    for r, values in enumerate(per_rank):
        assert sorted(values) == sorted(names), f"{what}: parameter names differ on rank {r}"
    check = (lambda a, e, w: torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"{w}: {m}")) \
        if exact else assert_close
    for name in names:
        kind, sizes = param_kind(ref, name)
        expected = ref_values[name]
        shards = [values[name] for values in per_rank]
        if kind == "vocab":
            assert torch.count_nonzero(expected[VOCAB:]) == 0, f"{what} {name}: tp=1 padding rows are not zero"
        compare_to_full(kind, sizes, shards, expected, f"{what} {name}", VOCAB, check)


# -- the tp=1 reference (parent process, no process group) -------------------------------------------
@functools.cache
def reference(family: str, tie: bool, pad: int, tp: int) -> dict:
    cfg = make_cfg(family, tie, pad, tp)
    tokens, labels, weights = make_batch()
    model = GPTModel(cfg, TPContext())
    model.init_weights(SEED)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = model.full_logits(tokens)
    loss = model(tokens, labels=labels)
    (loss * weights).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, f"tp=1 {n} has no gradient"
        grads[n] = p.grad.detach().clone()
    return dict(model=model, init=init, logits=logits, loss=loss.detach(), grads=grads)


# -- tp > 1 worker --------------------------------------------------------------------------------
def _parity_worker(rank: int, world_size: int, cases, tokens, labels, weights) -> list[dict]:
    topo = Topology.build(tp=world_size)
    group = topo.group("tp")
    out = []
    for family, tie, sp, pad in cases:
        cfg = make_cfg(family, tie, pad, world_size)
        model = GPTModel(cfg, TPContext(group=group, sequence_parallel=sp))
        model.init_weights(SEED)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            local_logits = model(tokens)  # [s, b, padded / tp]
        full_logits = model.full_logits(tokens)
        loss = model(tokens, labels=labels)
        (loss * weights).sum().backward()
        grads, partial, tags = {}, {}, {}
        for n, p in model.named_parameters():
            assert p.grad is not None, f"tp={world_size} {n} has no gradient"
            g = p.grad.detach().clone()
            tags[n] = (getattr(p, "tensor_parallel", False), getattr(p, "sequence_parallel", False))
            if getattr(p, "sequence_parallel", False):
                partial[n] = g.clone()
                dist.all_reduce(g, group=group)
            grads[n] = g
        out.append(dict(init=init, grads=grads, partial=partial, tags=tags, local_logits=local_logits,
                        full_logits=full_logits, loss=loss.detach()))
    return out


@functools.cache
def parity_results(tp: int) -> list[list[dict]]:
    """results[case][rank] for every case of CASES, from one run of tp ranks."""
    tokens, labels, weights = make_batch()
    by_rank = run_ranks(_parity_worker, tp, CASES, tokens, labels, weights, timeout=180)
    return [[by_rank[r][i] for r in range(tp)] for i in range(len(CASES))]


def _case_name(case) -> str:
    family, tie, sp, pad = case
    return f"{family} tie={tie} sp={sp} pad={pad}"


def check_weights(tp: int) -> None:
    for case, results in zip(CASES, parity_results(tp)):
        family, tie, sp, pad = case
        ref = reference(family, tie, pad, tp)
        compare_full(ref["model"], ref["init"], [r["init"] for r in results],
                     f"tp={tp} {_case_name(case)} initial weight", exact=True)


def check_logits_and_loss(tp: int) -> None:
    for case, results in zip(CASES, parity_results(tp)):
        family, tie, sp, pad = case
        ref = reference(family, tie, pad, tp)
        what = f"tp={tp} {_case_name(case)}"
        assert ref["logits"].shape == (BATCH, SEQ, VOCAB)
        gathered = torch.cat([r["local_logits"] for r in results], dim=-1)  # [s, b, padded]
        assert gathered.shape[:2] == (SEQ, BATCH) and gathered.shape[2] % (tp * pad) == 0
        assert torch.count_nonzero(gathered[..., VOCAB:]) == 0, f"{what}: logits of padding rows are not zero"
        for rank, r in enumerate(results):
            assert_close(r["full_logits"], ref["logits"], f"{what} full_logits on rank {rank}")
            assert_close(r["loss"], ref["loss"], f"{what} per-token loss on rank {rank}")
        assert_close(gathered[..., :VOCAB].transpose(0, 1), ref["logits"], f"{what} gathered local logits")


def check_grads(tp: int) -> None:
    for case, results in zip(CASES, parity_results(tp)):
        family, tie, sp, pad = case
        ref = reference(family, tie, pad, tp)
        what = f"tp={tp} {_case_name(case)} grad"
        compare_full(ref["model"], ref["grads"], [r["grads"] for r in results], what, exact=False)
        # Tags: split parameters are tensor_parallel; sequence_parallel exactly on the replicated
        # parameters that see a sequence slice (norms, row-parallel biases) when sp is on.
        for name, (is_tp, is_sp) in results[0]["tags"].items():
            kind, _ = param_kind(ref["model"], name)
            assert is_tp == (kind != "rep"), f"{what} {name}: tensor_parallel tag {is_tp}"
            seq_sliced = sp and kind == "rep" and name != "pos_embedding.weight"
            assert is_sp == seq_sliced, f"{what} {name}: sequence_parallel tag {is_sp}"
        if sp:
            assert results[0]["partial"], f"{what}: no sequence-parallel parameters"
            for name in results[0]["partial"]:
                # the per-rank grads are genuinely partial: they differ and sum to the full one
                parts = [r["partial"][name] for r in results]
                assert not torch.allclose(parts[0], parts[1]), f"{what} {name}: partial grads are equal"
                assert_close(sum(parts), ref["grads"][name], f"{what} {name}: sum of partial grads")


def test_weights_identical_tp2():
    check_weights(2)


@pytest.mark.slow
def test_weights_identical_tp4():
    check_weights(4)


def test_logits_and_loss_tp2():
    check_logits_and_loss(2)


@pytest.mark.slow
def test_logits_and_loss_tp4():
    check_logits_and_loss(4)


def test_grads_tp2():
    check_grads(2)


@pytest.mark.slow
def test_grads_tp4():
    check_grads(4)


def test_reference_is_sane():
    """The tp=1 reference itself: loss is cross entropy of the logits, grads are not trivial."""
    tokens, labels, weights = make_batch()
    for family in ("gpt2", "llama"):
        for tie in (True, False):
            ref = reference(family, tie, 8, 2)
            expected = torch.nn.functional.cross_entropy(ref["logits"].reshape(-1, VOCAB), labels.reshape(-1),
                                                         reduction="none").view(BATCH, SEQ)
            assert_close(ref["loss"], expected, f"{family} tie={tie} tp=1 loss vs F.cross_entropy")
            for name, g in ref["grads"].items():
                if not name.endswith("bias"):
                    assert g.abs().max() > 1e-4, f"{family} {name}: gradient ~0, the comparison would be vacuous"
            names = set(ref["grads"])
            assert ("output.weight" in names) == (not tie)
            assert ("pos_embedding.weight" in names) == (family == "gpt2")


# -- pipeline stages: layout-independent initialisation by name --------------------------------------
def _stages(cfg: ModelConfig, tp: TPContext):
    full = GPTModel(cfg, tp)
    first = GPTModel(cfg, tp, layer_range=range(0, 1), pre_process=True, post_process=False)
    middle = GPTModel(cfg, tp, layer_range=range(1, cfg.layers - 1), pre_process=False, post_process=False)
    last = GPTModel(cfg, tp, layer_range=range(cfg.layers - 1, cfg.layers), pre_process=False, post_process=True)
    for m in (full, first, middle, last):
        m.init_weights(SEED)
    return full, first, middle, last


def check_stages(cfg: ModelConfig, tp: TPContext, tokens, labels, what: str) -> None:
    full, first, middle, last = _stages(cfg, tp)
    full_params = dict(full.named_parameters())
    seen = set()
    for stage_name, stage in (("first", first), ("middle", middle), ("last", last)):
        for name, p in stage.named_parameters():
            if name == "output.weight" and cfg.tie_embeddings:
                # the last stage's copy of the tied embedding
                assert stage is last
                assert torch.equal(p, full_params["embedding.weight"]), f"{what}: output copy != embedding"
                assert getattr(p, "tied_across_stages", False) and getattr(p, "shared_embedding", False)
                continue
            assert name in full_params, f"{what}: {stage_name} stage has {name}, the full model does not"
            assert torch.equal(p, full_params[name]), f"{what}: {stage_name} stage {name} differs"
            seen.add(name)
    assert seen == set(full_params), f"{what}: stages miss {set(full_params) - seen}"
    assert set(dict(middle.named_parameters())) == {n for n in full_params if n.startswith("layers.1.")}
    assert (last.output is not None) and (full.output is None) == cfg.tie_embeddings
    if cfg.tie_embeddings:
        assert getattr(first.embedding.weight, "tied_across_stages", False)
        assert not getattr(full.embedding.weight, "tied_across_stages", False)
    # Running the stages one after the other gives the full model's output.
    with torch.no_grad():
        h = middle(hidden=first(tokens))
        assert_close(last(hidden=h), full(tokens), f"{what}: chained stage logits")
        assert_close(last(hidden=h, labels=labels), full(tokens, labels=labels), f"{what}: chained stage loss")


def test_pipeline_stages_tp1():
    tokens, labels, _ = make_batch()
    for family in ("gpt2", "llama"):
        for tie in (True, False):
            cfg = make_cfg(family, tie, 8, 1, layers=3)
            check_stages(cfg, TPContext(), tokens, labels, f"tp=1 {family} tie={tie}")


# -- tp=2: stages, dropout ----------------------------------------------------------------------------
def _final_hidden(model: GPTModel, tokens) -> torch.Tensor:
    x = model.embed(tokens)
    for layer in model.layers.values():
        x = layer(x)
    return x


def _tp2_worker(rank: int, world_size: int, tokens, labels) -> dict:
    topo = Topology.build(tp=world_size)
    group = topo.group("tp")
    out = {}
    for family in ("gpt2", "llama"):
        for tie in (True, False):
            cfg = make_cfg(family, tie, 8, world_size, layers=3)
            check_stages(cfg, TPContext(group=group, sequence_parallel=True), tokens, labels,
                         f"tp=2 sp {family} tie={tie}")

    for family in ("gpt2", "llama"):
        for sp in (False, True):
            key = f"{family} sp={sp}"
            cfg = make_cfg(family, False, 8, world_size, dropout=0.2)
            ctx = TPContext(group=group, sequence_parallel=sp)
            model = GPTModel(cfg, ctx)
            model.init_weights(SEED)
            plain = GPTModel(make_cfg(family, False, 8, world_size), TPContext(group=group, sequence_parallel=sp))
            plain.init_weights(SEED)

            model.train()
            try:  # no tracker at tp=2: refused, not the same mask on every TP rank
                model(tokens, labels=labels)
                raise AssertionError(f"{key}: dropout at tp=2 ran without an RNG tracker")
            except ValueError as e:
                assert "needs TPContext.rng" in str(e), e
            # train mode: runs, gives finite loss and gradients for every parameter
            ctx.rng = RNGTracker.for_rank(SEED, topo.tp_rank)
            tp_state = ctx.rng.states["tp"].clone()
            model.train()
            loss = model(tokens, labels=labels)
            assert torch.isfinite(loss).all(), key
            loss.sum().backward()
            for n, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), f"{key}: {n} grad"
            assert not torch.equal(ctx.rng.states["tp"], tp_state), f"{key}: the tp RNG stream was never used"
            with torch.no_grad():
                again = model(tokens, labels=labels)  # fresh masks
                ctx.rng = RNGTracker.for_rank(SEED, topo.tp_rank)
                replay = model(tokens, labels=labels)  # the same masks as the first forward
                ctx.rng = RNGTracker.for_rank(SEED, topo.tp_rank)
                hidden = _final_hidden(model, tokens)
                model.eval()
                eval_loss = model(tokens, labels=labels)
            assert not torch.equal(again, loss.detach()), f"{key}: dropout masks did not change"
            assert_close(replay, loss.detach(), f"{key}: reseeded forward")
            assert not torch.allclose(loss.detach(), eval_loss), f"{key}: dropout had no effect in train mode"
            # eval mode: dropout > 0 gives exactly the dropout = 0 model
            plain.eval()
            assert_close(model.full_logits(tokens), plain.full_logits(tokens), f"{key}: eval logits")
            assert_close(eval_loss, plain(tokens, labels=labels).detach(), f"{key}: eval loss")
            out[key] = dict(loss=loss.detach(), hidden=hidden, tp_state=tp_state)
    return out


@pytest.mark.slow
def test_stages_and_dropout_tp2():
    tokens, labels, _ = make_batch()
    results = run_ranks(_tp2_worker, 2, tokens, labels, timeout=120)
    for key in results[0]:
        r0, r1 = results[0][key], results[1][key]
        assert torch.equal(r0["loss"], r1["loss"]), key
        assert not torch.equal(r0["tp_state"], r1["tp_state"]), f"{key}: TP ranks share the tp RNG stream"
        if "sp=False" in key:
            # the replicated residual stream (and its dropout masks) is identical on both TP ranks
            assert torch.equal(r0["hidden"], r1["hidden"]), f"{key}: residual stream diverged across TP ranks"
        else:
            assert r0["hidden"].shape[0] == SEQ // 2
