"""Sampling from a tensor- and pipeline-parallel model (inference/generate.py) against one process."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.inference.generate import generate
from tessera.models.transformer import TPContext
from tessera.pipeline_parallel.p2p import P2P
from tessera.pipeline_parallel.stage import build_stage_chunks
from tessera.testing import run_ranks
from tessera.topology import Topology

CFG = ModelConfig(vocab_size=50, hidden=32, heads=4, layers=2, seq_len=8)
PROMPT, NEW = [1, 2, 3], 10  # (the context slides past seq_len)


def _chunks(topo: Topology, sp: bool = False):
    tp = TPContext(group=topo.group("tp"), sequence_parallel=sp)
    chunks = build_stage_chunks(CFG, tp, topo.pp_rank, topo.pp, 1, None, topo.device)
    for chunk in chunks:
        chunk.init_weights(7)
    return chunks


def _sample_worker(rank: int, world: int, tp: int, pp: int, sp: bool) -> list[int]:
    topo = Topology.build(tp=tp, pp=pp)
    return generate(_chunks(topo, sp), PROMPT, NEW, topo=topo, p2p=P2P(topo) if pp > 1 else None, seed=3)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,pp,sp", [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_every_rank_samples_what_one_process_samples(tp, pp, sp):
    (one,) = run_ranks(_sample_worker, 1, 1, 1, False, timeout=60)
    assert len(one) == len(PROMPT) + NEW and one[:3] == PROMPT
    for ids in run_ranks(_sample_worker, tp * pp, tp, pp, sp, timeout=120):
        assert ids == one


# -- tp x pp, and two model chunks per rank ----------------------------------------------------------------
CFG_4 = ModelConfig(vocab_size=50, hidden=32, heads=4, layers=4, seq_len=8)  # 4 layers: vpp=2 at pp=2


def _sample(tp: int, pp: int, vpp: int, sp: bool = False) -> list[int]:
    topo = Topology.build(tp=tp, pp=pp)
    chunks = build_stage_chunks(CFG_4, TPContext(group=topo.group("tp"), sequence_parallel=sp), topo.pp_rank,
                                topo.pp, vpp, None, topo.device)
    for chunk in chunks:
        chunk.init_weights(7)
    return generate(chunks, PROMPT, NEW, topo=topo, p2p=P2P(topo) if pp > 1 else None, seed=3)


def _four_rank_sample_worker(rank: int, world: int) -> dict:
    return {"tp2-pp2": _sample(2, 2, 1), "tp2-sp-pp2": _sample(2, 2, 1, sp=True), "tp2-pp2-vpp2": _sample(2, 2, 2)}


def _two_rank_sample_worker(rank: int, world: int) -> dict:
    return {"pp2-vpp2": _sample(1, 2, 2)}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sampling_at_tp2_pp2_and_with_two_chunks_matches_one_process():
    """generate() over tp=2 x pp=2 (with and without SP), and over two model chunks per rank
    (vpp=2: the context goes around the pipeline twice), gives every rank the ids one process
    draws from the same weights and seed."""
    one = _sample(1, 1, 1)
    assert len(one) == len(PROMPT) + NEW and one[:3] == PROMPT
    for out in run_ranks(_two_rank_sample_worker, 2, timeout=120):
        assert out["pp2-vpp2"] == one
    for out in run_ranks(_four_rank_sample_worker, 4, timeout=180):
        assert out == dict.fromkeys(("tp2-pp2", "tp2-sp-pp2", "tp2-pp2-vpp2"), one)


CFG_ODD = ModelConfig(vocab_size=50, hidden=32, heads=4, layers=2, seq_len=7)  # seq_len not divisible by tp=2


def _odd_seq_len_worker(rank: int, world: int, tp: int) -> list[int]:
    topo = Topology.build(tp=tp)
    chunks = build_stage_chunks(CFG_ODD, TPContext(group=topo.group("tp")), topo.pp_rank, topo.pp, 1, None,
                                topo.device)
    for chunk in chunks:
        chunk.init_weights(7)
    return generate(chunks, [1, 2, 3, 4, 5, 6], 8, topo=topo, seed=3)


@pytest.mark.timeout(240)
def test_tp_without_sequence_parallel_keeps_the_whole_context():
    """Without sequence parallelism the context is not padded to a multiple of tp: padding it
    past seq_len used to cut it (7 tokens of context became 5 at tp=2) and change the samples."""
    (one,) = run_ranks(_odd_seq_len_worker, 1, 1, timeout=60)
    for ids in run_ranks(_odd_seq_len_worker, 2, 2, timeout=120):
        assert ids == one


def _training_after_sampling_worker(rank: int, world: int) -> str:
    """A trainer's P2P keeps its first step's shapes; sampling in between sends other shapes, and
    the next training step must still send its own."""
    topo = Topology.build(pp=2)
    chunks, p2p = _chunks(topo), P2P(topo, keep_shapes=True)

    def training_like_step():
        p2p.new_step()
        if topo.pp_rank == 0:
            p2p.send("F", 1, 0, torch.zeros(8, 2, 32))
            p2p.wait_sends()
        else:
            p2p.recv("F", 0, 0).wait()
    training_like_step()
    generate(chunks, PROMPT, 2, topo=topo, p2p=p2p)
    training_like_step()
    return "trained on"


@pytest.mark.timeout(120)
def test_a_training_step_after_sampling_sends_its_own_shapes():
    assert run_ranks(_training_after_sampling_worker, 2, timeout=60) == ["trained on"] * 2


@pytest.mark.parametrize("prompt,kwargs,problem", [
    ([], {}, "a prompt of at least one token id"),
    ([1, 50], {}, r"prompt ids \[50\] are outside the model's vocabulary \[0, 50\)"),
    ([-1], {}, "outside the model's vocabulary"),
    ([1], {"top_k": -1}, "top_k >= 0"),
    ([1], {"temperature": float("nan")}, "temperature >= 0"),
])
def test_bad_input_is_refused_naming_it(prompt, kwargs, problem):
    topo = Topology.build()
    with pytest.raises(ValueError, match=problem):
        generate(_chunks(topo), prompt, 2, topo=topo, **kwargs)


def test_the_model_is_put_back_in_training_mode_after_an_error(monkeypatch):
    from tessera.inference import generate as module

    topo = Topology.build()
    chunks = _chunks(topo)
    chunks[0].train()
    seen = []

    def failing(chunks, *args):
        seen.append(chunks[0].training)
        raise RuntimeError("failed mid-sample")
    monkeypatch.setattr(module, "_last_stage_logits", failing)
    with pytest.raises(RuntimeError, match="failed mid-sample"):
        generate(chunks, PROMPT, 2, topo=topo)
    assert seen == [False] and chunks[0].training


def test_greedy_sampling_takes_the_most_likely_next_token():
    """top_k=1: each new id is the argmax of the model's logits at the context's last position."""
    topo = Topology.build()
    (model,) = _chunks(topo)
    ids = generate([model], PROMPT, 4, topo=topo, top_k=1)
    with torch.no_grad():
        model.eval()
        for n in range(len(PROMPT), len(ids)):
            logits = model(tokens=torch.tensor([ids[:n]]))[:, 0, :CFG.vocab_size]
            assert ids[n] == int(logits[-1].argmax())
