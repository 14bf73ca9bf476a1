"""Pipeline parallelism end to end: every schedule gives the pp=1 model's loss and gradients.

For pp in {2, 4}, vpp in {1, 2}, m in {pp, 2*pp + 1} micro-batches and every valid schedule kind
(1f1b, gpipe, zb-h1 at vpp=1; interleaved at vpp=2), with tied and untied embeddings, GPT-2 and
Llama, uneven explicit layouts, and combined with tp=2 (with and without sequence parallelism):
the summed loss on the last stage and every parameter's gradient (after finalize_model_grads)
equal those of the whole model run on one process (fp32). Also: the executor's own count of
micro-batches holding activations (1f1b / zb-h1 bounded by pp - rank, gpipe holds all m), a
shape change within a step refused with ShapeError, and a new step with another shape
renegotiated.

All cases of one world size run in ONE ``run_ranks`` call (the worker loops over them and returns
gradients; the parent compares them with the reference, computed here without a process group).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ModelConfig
from tessera.distributed.finalize import finalize_model_grads, param_grads
from tessera.models import GPTModel, TPContext
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.pipeline_parallel.p2p import P2P, ShapeError
from tessera.pipeline_parallel.schedules import SPLIT_BACKWARD, build_all, build_schedule
from tessera.pipeline_parallel.simulator import simulate
from tessera.pipeline_parallel.stage import build_stage_chunks
from tessera.tensor_parallel.wgrad import WeightGradStore
from tessera.testing import run_ranks
from tessera.topology import Topology

from parity import assert_close, compare_to_full, param_kind
from training_runs import shared_result

SEED = 1234
VOCAB, HIDDEN, SEQ, BATCH = 50, 32, 8, 2
PAD = 8  # padded vocabulary: 56 at tp=1, 64 at tp=2 (only the first VOCAB rows are compared)
# fp32 tolerances as in test_tensor_parallel_model: the summation order differs between layouts (per
# micro-batch accumulation, tied-copy all-reduce, TP partial sums), which costs a few ulp of the
# largest terms, so the absolute tolerance is relative to the tensor's largest magnitude.


@dataclass(frozen=True)
class Case:
    kind: str
    pp: int
    vpp: int
    m: int
    tie: bool
    family: str = "gpt2"
    layout: tuple[int, ...] | None = None
    tp: int = 1
    sp: bool = False
    seed: int = 0  # data seed

    @property
    def layers(self) -> int:
        return 4 if self.pp == 2 else 8

    def __str__(self) -> str:
        layout = f" layout={list(self.layout)}" if self.layout else ""
        return (f"{self.kind} pp={self.pp} vpp={self.vpp} tp={self.tp} sp={self.sp} m={self.m} "
                f"{self.family} tie={self.tie}{layout}")


def _matrix(pp: int) -> list[Case]:
    """Every valid kind at vpp=1 and vpp=2 for m in {pp, 2*pp+1}, tied and untied across the set."""
    cases = []
    for i, (kind, vpp) in enumerate((("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2))):
        for j, m in enumerate((pp, 2 * pp + 1)):
            tie = (i + j) % 2 == 0  # every kind runs once tied and once untied
            family = "llama" if (i + j + pp // 2) % 3 == 0 else "gpt2"
            cases.append(Case(kind, pp, vpp, m, tie, family, seed=10 * i + j + pp))
    return cases


PP2_CASES = _matrix(2) + [
    Case("1f1b", 2, 1, 5, True, "gpt2", layout=(1, 3), seed=101),
    Case("zb-h1", 2, 1, 3, False, "llama", layout=(3, 1), seed=102),
    Case("gpipe", 2, 1, 3, True, "llama", layout=(1, 3), seed=103),
    # interleaved with an uneven layout (the first virtual stage holds only the embedding) and a
    # partial last round of micro-batches
    Case("interleaved", 2, 2, 3, True, "gpt2", layout=(0, 2, 1, 1), seed=104),
    # interleaved with the backward split: rank 1's W's two I's late; a partial round, uneven layout
    Case("interleaved-zb", 2, 2, 4, True, "gpt2", seed=109),
    Case("interleaved-zb", 2, 2, 3, False, "llama", layout=(0, 2, 1, 1), seed=110),
]
PP4_CASES = _matrix(4) + [Case("1f1b", 4, 1, 4, False, "gpt2", layout=(1, 3, 3, 1), seed=105),
                          Case("interleaved-zb", 4, 2, 8, True, "llama", seed=111)]
PP2_TP2_CASES = [
    Case("1f1b", 2, 1, 5, True, "gpt2", tp=2, sp=True, seed=201),
    Case("zb-h1", 2, 1, 2, False, "llama", tp=2, sp=False, seed=202),
    Case("interleaved", 2, 2, 5, False, "llama", tp=2, sp=True, seed=203),
    Case("gpipe", 2, 1, 3, True, "gpt2", tp=2, sp=False, layout=(1, 3), seed=204),
    Case("zb-h1", 2, 1, 5, True, "gpt2", tp=2, sp=True, seed=205),
    Case("interleaved-zb", 2, 2, 4, False, "gpt2", tp=2, sp=True, seed=206),
]
PP4_TP2_CASES = [
    Case("1f1b", 4, 1, 9, True, "gpt2", tp=2, sp=True, seed=301),
    Case("interleaved", 4, 2, 4, False, "llama", tp=2, sp=False, seed=302),
    Case("zb-h1", 4, 1, 4, True, "llama", tp=2, sp=True, seed=303),
]

# An odd ring: with interleaving, rank 2 sends activations on to rank 0 and rank 0 sends
# gradients back to rank 2, next to the ordinary neighbour traffic.
PP3_CASES = [
    Case("interleaved", 3, 2, 3, True, "gpt2", layout=(1, 1, 2, 2, 1, 1), seed=501),
    Case("interleaved", 3, 2, 7, False, "llama", layout=(1, 1, 2, 2, 1, 1), seed=502),
    Case("1f1b", 3, 1, 4, True, "llama", layout=(2, 4, 2), seed=503),
    Case("zb-h1", 3, 1, 7, False, "gpt2", layout=(3, 3, 2), seed=504),
    Case("interleaved-zb", 3, 2, 7, True, "gpt2", layout=(1, 1, 2, 2, 1, 1), seed=505),
]

# Renegotiation: one executor (one P2P) runs two steps with different shapes.
RENEGOTIATE = [Case("1f1b", 2, 1, 3, True, "gpt2", seed=401), Case("interleaved", 2, 2, 3, False, "llama", seed=402)]
SECOND_STEP = dict(batch=3, seq=6)  # step 2: another batch size and sequence length


def make_cfg(case: Case) -> ModelConfig:
    common = dict(vocab_size=VOCAB, vocab_pad_multiple=PAD, hidden=HIDDEN, layers=case.layers, seq_len=SEQ,
                  tie_embeddings=case.tie, init_std=0.1)
    if case.family == "gpt2":
        return ModelConfig(family="gpt2", heads=2, **common)
    return ModelConfig(family="llama", heads=4, kv_heads=2, **common)  # grouped-query attention


def make_micro_batches(m: int, seed: int, batch: int = BATCH, seq: int = SEQ) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
        mask = (torch.rand(batch, seq, generator=g) > 0.3).float()  # a non-uniform token count
        mask[0, 0] = 1.0
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
    return out


def global_tokens(micro_batches) -> torch.Tensor:
    return sum(mb["loss_mask"].sum() for mb in micro_batches).to(torch.float32)


# -- the pp=1 reference (parent process, no process group) -----------------------------------------
@functools.cache
def reference(case: Case, batch: int = BATCH, seq: int = SEQ) -> dict:
    micro_batches = make_micro_batches(case.m, case.seed, batch, seq)
    total = global_tokens(micro_batches)
    model = GPTModel(make_cfg(case))
    model.init_weights(SEED)
    loss_sum = torch.zeros(())
    for mb in micro_batches:
        loss = (model(mb["tokens"], labels=mb["labels"]) * mb["loss_mask"]).sum() / total
        loss.backward()
        loss_sum += loss.detach()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"reference {name} has no gradient"
        if not name.endswith("bias"):
            assert p.grad.abs().max() > 1e-5, f"reference {name}: gradient ~0, the comparison would be vacuous"
        grads[name] = p.grad.detach().clone()
    return dict(model=model, loss=loss_sum, grads=grads)


# -- rank worker ---------------------------------------------------------------------------------------
def _run_case(topo: Topology, case: Case, steps: list[dict]) -> list[dict]:
    """Build this rank's stage for ``case`` and run one executor step per entry of ``steps``
    (dicts of batch/seq), zeroing gradients between steps; returns what each step left."""
    cfg = make_cfg(case)
    store = WeightGradStore() if case.kind in SPLIT_BACKWARD else None
    tp = TPContext(group=topo.group("tp"), sequence_parallel=case.sp)
    layout = list(case.layout) if case.layout else None
    chunks = build_stage_chunks(cfg, tp, topo.pp_rank, case.pp, case.vpp, layout=layout)
    for chunk in chunks:
        chunk.init_weights(SEED)
        chunk.use_weight_grad_store(store)
    model = nn.ModuleList(chunks)
    actions = build_schedule(case.kind, case.pp, case.vpp, case.m, topo.pp_rank)
    # One tag for every message: gloo then matches them in posting order, as NCCL does, so a
    # schedule whose two ends post in different orders delivers wrong tensors and fails here.
    executor = PipelineExecutor(chunks, actions, P2P(topo, match_in_order=True), case.pp, topo.pp_rank, store)
    out = []
    for shape in steps:
        micro_batches = make_micro_batches(case.m, case.seed, shape["batch"], shape["seq"])
        model.zero_grad(set_to_none=True)
        loss = executor.run(micro_batches, global_tokens(micro_batches))
        finalize_model_grads(param_grads(model), topo, done=())
        grads = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                assert name not in grads, f"{name} held by two chunks of one rank"
                grads[name] = None if p.grad is None else p.grad.detach().clone()
        out.append(dict(loss=loss.detach().clone(), grads=grads, peak=executor.peak_in_flight,
                        peak_w=executor.peak_weight_grads_pending, peak_held=executor.peak_held,
                        pending_w=len(store) if store is not None else 0, pp_rank=topo.pp_rank,
                        tp_rank=topo.tp_rank, stage_layers=[list(c.layer_range) for c in chunks]))
    return out


def _shape_change_within_step(topo: Topology) -> str | None:
    """pp=2 gpipe with 3 micro-batches, the second one shorter: rank 0 must refuse to send it.

    Rank 1 does not run the step (it would wait forever for the refused message): it receives
    the first micro-batch's activation, as the executor would, so rank 0's sends can complete.
    """
    case = Case("gpipe", 2, 1, 3, False, "gpt2", seed=501)
    micro_batches = make_micro_batches(3, case.seed)
    micro_batches[1] = make_micro_batches(1, case.seed + 1, seq=SEQ // 2)[0]
    message = None
    if topo.pp_rank == 0:
        cfg = make_cfg(case)
        chunks = build_stage_chunks(cfg, TPContext(), 0, 2, 1)
        chunks[0].init_weights(SEED)
        p2p = P2P(topo)
        executor = PipelineExecutor(chunks, build_schedule("gpipe", 2, 1, 3, 0), p2p, 2, 0)
        try:
            executor.run(micro_batches, global_tokens(micro_batches))
            message = "no error"
        except ShapeError as e:
            message = str(e)
        p2p.wait_sends()
    else:
        first = P2P(topo).recv("F", 0, 0).wait()
        assert tuple(first.shape) == (SEQ, BATCH, HIDDEN), first.shape
    dist.barrier()
    return message


def _pipeline_worker(rank: int, world_size: int, groups: list[tuple[int, int, list[Case], list[Case]]]) -> dict:
    """``groups``: (tp, pp, cases, renegotiation cases) run on one topology each, in order."""
    out = {"cases": [], "renegotiate": []}
    for tp, pp, cases, renegotiate in groups:
        topo = Topology.build(tp=tp, pp=pp)
        one = [dict(batch=BATCH, seq=SEQ)]
        out["cases"] += [_run_case(topo, case, one)[0] for case in cases]
        two = [dict(batch=BATCH, seq=SEQ), SECOND_STEP]
        out["renegotiate"] += [_run_case(topo, case, two) for case in renegotiate]
    return out


def _shape_worker(rank: int, world_size: int) -> str | None:
    return _shape_change_within_step(Topology.build(pp=2))


RUNS = {  # world size -> (tp, pp, cases, renegotiation cases) per topology
    2: [(1, 2, PP2_CASES, RENEGOTIATE)],
    3: [(1, 3, PP3_CASES, [])],
    4: [(1, 4, PP4_CASES, []), (2, 2, PP2_TP2_CASES, [])],
    8: [(2, 4, PP4_TP2_CASES, [])],
}


_RESULTS: dict[int, dict | BaseException] = {}


def results(world_size: int) -> dict:
    """{'cases': [(case, [per-rank result])], 'renegotiate': [(case, [per-rank [step1, step2]])]}

    One run per world size, shared by the tests; a failed run is remembered too, so that a hang
    costs one deadline, not one per test."""
    return shared_result(_RESULTS, world_size, lambda: _results(world_size))


def _results(world_size: int) -> dict:
    groups = RUNS[world_size]
    by_rank = run_ranks(_pipeline_worker, world_size, groups, timeout=120)
    cases = [case for _, _, cs, _ in groups for case in cs]
    reneg = [case for _, _, _, rs in groups for case in rs]
    return dict(
        cases=[(case, [r["cases"][i] for r in by_rank]) for i, case in enumerate(cases)],
        renegotiate=[(case, [r["renegotiate"][i] for r in by_rank]) for i, case in enumerate(reneg)])


# -- comparison ----------------------------------------------------------------------------------------
def check_case(case: Case, per_rank: list[dict], ref: dict, what: str) -> None:
    model, ref_grads = ref["model"], ref["grads"]
    assert len(per_rank) == case.tp * case.pp
    by_coord = {(r["pp_rank"], r["tp_rank"]): r for r in per_rank}
    assert sorted(by_coord) == [(p, t) for p in range(case.pp) for t in range(case.tp)], what
    # loss: the summed loss on every TP rank of the last stage, zero on the other stages
    for (p, t), r in by_coord.items():
        if p == case.pp - 1:
            assert_close(r["loss"], ref["loss"], f"{what}: loss on pp rank {p} tp rank {t}")
        else:
            assert r["loss"].item() == 0.0, f"{what}: pp rank {p} reported loss {r['loss'].item()}"
        assert r["pending_w"] == 0, f"{what}: {r['pending_w']} deferred weight gradients never ran"
    # every parameter on exactly one stage (the tied output copy aside)
    holders: dict[str, list[int]] = {}
    for p in range(case.pp):
        for name in by_coord[(p, 0)]["grads"]:
            holders.setdefault(name, []).append(p)
    expected_names = set(ref_grads) | ({"output.weight"} if case.tie and case.pp > 1 else set())
    assert set(holders) == expected_names, f"{what}: parameters {set(holders) ^ expected_names} differ"
    for name, stages in holders.items():
        assert len(stages) == 1, f"{what}: {name} on pp ranks {stages}"
    # gradients, TP shards gathered
    for name, (p,) in holders.items():
        source = "embedding.weight" if (case.tie and name == "output.weight") else name
        kind, sizes = param_kind(model, source)
        expected = ref_grads[source]
        shards = []
        for t in range(case.tp):
            g = by_coord[(p, t)]["grads"][name]
            assert g is not None, f"{what}: {name} has no gradient on pp rank {p} tp rank {t}"
            shards.append(g)
        compare_to_full(kind, sizes, shards, expected, f"{what}: grad {name} (pp rank {p})", VOCAB)


def check_world(world_size: int) -> None:
    res = results(world_size)
    assert res["cases"], world_size
    for case, per_rank in res["cases"]:
        check_case(case, per_rank, reference(case), str(case))


@pytest.mark.slow
def test_pipeline_pp2_matches_reference():
    check_world(2)


@pytest.mark.slow
def test_pipeline_pp3_odd_ring_matches_reference():
    check_world(3)


@pytest.mark.slow
def test_pipeline_pp4_and_pp2_tp2_match_reference():
    check_world(4)


@pytest.mark.slow
def test_pipeline_pp4_tp2_matches_reference():
    check_world(8)


def test_case_matrix_covers_every_kind_and_size():
    """The matrix really covers what the tests claim (guards against a case list edited away)."""
    for pp, cases in ((2, PP2_CASES), (4, PP4_CASES)):
        plain = [c for c in cases if c.layout is None]
        for kind, vpp in (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)):
            ms = {c.m for c in plain if (c.kind, c.vpp) == (kind, vpp)}
            assert ms == {pp, 2 * pp + 1}, (pp, kind, ms)
            ties = {c.tie for c in plain if c.kind == kind}
            assert ties == {True, False}, (pp, kind)
        assert any(c.layout for c in cases), pp
    for cases in (PP2_TP2_CASES, PP4_TP2_CASES):
        assert {c.sp for c in cases} == {True, False} and len({c.kind for c in cases}) >= 2


@pytest.mark.slow
def test_uneven_layout_places_layers_as_given():
    res = results(2)
    for case, per_rank in res["cases"]:
        if case.layout is None:
            continue
        starts = [sum(case.layout[:i]) for i in range(len(case.layout))]
        expected = [list(range(s, s + n)) for s, n in zip(starts, case.layout)]
        for r in per_rank:
            got = r["stage_layers"]
            assert got == [expected[c * case.pp + r["pp_rank"]] for c in range(case.vpp)], (str(case), got)


@pytest.mark.slow
def test_peak_in_flight_is_bounded_by_the_schedule():
    """1f1b and zb-h1 hold at most pp - rank micro-batches' activations (exactly pp on rank 0);
    zb-h1 holds at most pp micro-batches from F to W (deferred W's included); gpipe holds all m;
    as counted by the executor itself, and as the simulator predicts."""
    seen = set()
    for world in (2, 4, 8):
        for case, per_rank in results(world)["cases"]:
            timeline = simulate(build_all(case.kind, case.pp, case.vpp, case.m), case.vpp)
            for r in per_rank:
                peak, p = r["peak"], r["pp_rank"]
                what = f"{case} pp rank {p}: peak_in_flight {peak}"
                assert 1 <= peak <= case.m * case.vpp, what
                assert peak == timeline.peak_in_flight(p), f"{what}, simulated {timeline.peak_in_flight(p)}"
                assert r["peak_w"] == timeline.peak_weight_grads_pending(p), what
                assert r["peak_held"] == timeline.peak_held(p), what
                # a W deferred by d micro-batches: d + 1 pending after each I (rank r: d = r, or k r)
                # (interleaved-zb: counted in I's of micro-batch chunks, 2r of them)
                defer = {"zb-h1": p, "interleaved-zb": 2 * p}.get(case.kind)
                assert r["peak_w"] == (0 if defer is None else min(case.m * case.vpp, defer + 1)), what
                if case.kind == "zb-h1":  # from F to W: within 1F1B's bound of rank 0
                    assert r["peak_held"] <= case.pp, what
                if case.kind in ("1f1b", "zb-h1"):
                    assert peak <= case.pp - p, what
                    if p == 0 and case.m >= case.pp:
                        assert peak == case.pp, what
                    seen.add(case.kind)
                if case.kind == "gpipe":
                    assert peak == case.m, what
                    if case.m > case.pp:
                        seen.add("gpipe")
    assert seen == {"1f1b", "zb-h1", "gpipe"}


def test_shape_change_within_a_step_is_refused():
    # separate short run: if the shape went through unchecked, rank 0 would wait forever for a
    # gradient that rank 1 never sends, and the deadline turns that into a failure
    messages = run_ranks(_shape_worker, 2, timeout=60)
    message = messages[0]
    assert message != "no error", "a micro-batch of another shape was sent without complaint"
    long, short = str((SEQ, BATCH, HIDDEN)), str((SEQ // 2, BATCH, HIDDEN))
    assert long in message and short in message, message
    assert messages[1] is None


@pytest.mark.slow
def test_new_step_with_other_shapes_renegotiates():
    res = results(2)["renegotiate"]
    assert len(res) == len(RENEGOTIATE)
    for case, per_rank in res:
        first = [steps[0] for steps in per_rank]
        second = [steps[1] for steps in per_rank]
        check_case(case, first, reference(case), f"{case} step 1")
        ref2 = reference(case, SECOND_STEP["batch"], SECOND_STEP["seq"])
        assert not torch.allclose(ref2["loss"], reference(case)["loss"])
        check_case(case, second, ref2, f"{case} step 2 (batch {SECOND_STEP['batch']}, seq {SECOND_STEP['seq']})")
