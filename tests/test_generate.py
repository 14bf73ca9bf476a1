"""Generation (inference/generate.py, models/kv_cache.py): with the KV cache it draws what the
whole-context reference draws, batched as one by one, and over tp, pp (with and without sequence
parallelism, two chunks per rank) what one process draws."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.inference.generate import generate
from tessera.inference.sampling import Sampling, next_tokens
from tessera.models.transformer import TPContext
from tessera.pipeline_parallel.p2p import P2P
from tessera.pipeline_parallel.stage import build_stage_chunks
from tessera.testing import run_ranks
from tessera.topology import Topology

CFG = ModelConfig(vocab_size=50, hidden=32, heads=4, layers=2, seq_len=8)
LLAMA = ModelConfig(family="llama", vocab_size=50, hidden=32, heads=4, kv_heads=2, layers=4, seq_len=12,
                    tie_embeddings=False)
PROMPT, NEW = [1, 2, 3], 10  # (the context slides past seq_len)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]  # of different lengths, batched together
DRAWN = Sampling(temperature=0.8, top_k=40, seed=3)  # the run's closing sample draws so


def _chunks(topo: Topology, cfg: ModelConfig = CFG, sp: bool = False, vpp: int = 1):
    tp = TPContext(group=topo.group("tp"), sequence_parallel=sp)
    chunks = build_stage_chunks(cfg, tp, topo.pp_rank, topo.pp, vpp, None, topo.device)
    for chunk in chunks:
        chunk.init_weights(7)
    return chunks


def _generate(tp: int, pp: int, *, cfg=CFG, sp=False, vpp=1, prompts=PROMPTS, new=NEW, **kwargs) -> list[list[int]]:
    topo = Topology.build(tp=tp, pp=pp)
    return generate(_chunks(topo, cfg, sp, vpp), prompts, new, topo=topo, p2p=P2P(topo) if pp > 1 else None,
                    **kwargs)


def _every_way(cfg: ModelConfig, tp: int, pp: int, sp: bool = False, vpp: int = 1) -> dict:
    """Greedy and drawn batches, and a single prompt drawn as the closing sample draws it."""
    run = dict(cfg=cfg, tp=tp, pp=pp, sp=sp, vpp=vpp)
    return {"greedy": _generate(**run), "drawn": _generate(**run, sampling=DRAWN),
            "one": _generate(**run, prompts=[PROMPT], sampling=DRAWN)}


FAMILIES = {"gpt2": CFG, "llama": LLAMA}


def _layout_worker(rank: int, world: int, tp: int, pp: int, sp: bool, families: list[str]) -> dict:
    return {name: _every_way(FAMILIES[name], tp, pp, sp) for name in families}


def _one_process(families: list[str]) -> dict:
    return {name: _every_way(FAMILIES[name], 1, 1) for name in families}


@pytest.mark.timeout(240)
def test_tp2_with_sequence_parallelism_generates_what_one_process_generates():
    """Batched prompts of different lengths, greedy and drawn, Llama with GQA; under SP the
    decode steps' tokens are split over tp (the batch of 4 prompts) and a single prompt's batch
    is rounded up with a dummy row, which draws nothing."""
    one = _one_process(["llama"])
    assert [len(ids) for ids in one["llama"]["greedy"]] == [len(p) + NEW for p in PROMPTS]
    for out in run_ranks(_layout_worker, 2, 2, 1, True, ["llama"], timeout=180):
        assert out == one


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp,sp", [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_tp2_and_pp2_generate_what_one_process_generates(tp, pp, sp):
    """GPT-2 (learned positions) and Llama (RoPE, GQA)."""
    one = _one_process(list(FAMILIES))
    for out in run_ranks(_layout_worker, tp * pp, tp, pp, sp, list(FAMILIES), timeout=180):
        assert out == one


def _four_rank_worker(rank: int, world: int) -> dict:
    return {"tp2-pp2": _every_way(LLAMA, 2, 2), "tp2-sp-pp2": _every_way(LLAMA, 2, 2, sp=True),
            "tp2-pp2-vpp2": _every_way(LLAMA, 2, 2, vpp=2)}


def _two_chunk_worker(rank: int, world: int) -> dict:
    return {"pp2-vpp2": _every_way(LLAMA, 1, 2, vpp=2)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_pp2_and_two_chunks_per_rank_generate_what_one_process_generates():
    """tp=2 x pp=2 (with and without SP), and two model chunks per rank (vpp=2: every step goes
    around the pipeline twice)."""
    one = _every_way(LLAMA, 1, 1)
    for out in run_ranks(_two_chunk_worker, 2, timeout=180):
        assert out["pp2-vpp2"] == one
    for out in run_ranks(_four_rank_worker, 4, timeout=240):
        assert out == dict.fromkeys(("tp2-pp2", "tp2-sp-pp2", "tp2-pp2-vpp2"), one)


@pytest.mark.parametrize("cfg,sampling", [(CFG, Sampling()), (LLAMA, Sampling()), (LLAMA, DRAWN),
                                          (CFG, Sampling(temperature=1.0, top_p=0.8, seed=1))],
                         ids=["gpt2-greedy", "llama-greedy", "llama-top-k", "gpt2-top-p"])
def test_the_cache_draws_what_the_whole_context_draws(cfg, sampling):
    """Prefill and one-token decode steps against the cache equal the reference that runs the
    whole context through the plain forward each step (left padding as a document of its own),
    past model.seq_len too (both then slide); greedy batches equal their prompts one by one."""
    topo = Topology.build()
    chunks = _chunks(topo, cfg)
    new = cfg.seq_len + 3
    cached = generate(chunks, PROMPTS, new, topo=topo, sampling=sampling)
    assert cached == generate(chunks, PROMPTS, new, topo=topo, sampling=sampling, use_cache=False)
    assert [len(ids) for ids in cached] == [len(p) + new for p in PROMPTS]
    if sampling.temperature == 0:
        assert cached == [generate(chunks, [p], new, topo=topo)[0] for p in PROMPTS]


def test_a_sequence_ends_after_its_stop_id():
    """Each sequence stops at the first stop id it draws (kept), the others go on; a stop id in
    the prompt stops nothing."""
    topo = Topology.build()
    chunks = _chunks(topo, LLAMA)
    free = generate(chunks, PROMPTS, 6, topo=topo)
    stop = free[1][len(PROMPTS[1]) + 2]  # the third id drawn for the second prompt
    stopped = generate(chunks, PROMPTS, 6, topo=topo, stop_ids=(stop, 49))
    for prompt, whole, cut in zip(PROMPTS, free, stopped):
        drawn = whole[len(prompt):]
        end = next((i + 1 for i, t in enumerate(drawn) if t in (stop, 49)), len(drawn))
        assert cut == prompt + drawn[:end]
    assert len(stopped[1]) == len(PROMPTS[1]) + 3
    assert generate(chunks, [[stop, 1]], 3, topo=topo, stop_ids=(stop,))[0][:2] == [stop, 1]


def test_the_closing_sample_draws_as_before():
    """One prompt at temperature 0.8 and top-k 40 (train.sample_tokens' settings), past seq_len:
    the tokens the reference path draws, so a run's sample is what it was before the cache."""
    topo = Topology.build()
    chunks = _chunks(topo)
    for seed in range(3):
        sampling = Sampling(temperature=0.8, top_k=40, seed=seed)
        assert generate(chunks, [PROMPT], NEW, topo=topo, sampling=sampling) == \
            generate(chunks, [PROMPT], NEW, topo=topo, sampling=sampling, use_cache=False)


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
    generate(chunks, PROMPTS, 3, topo=topo, p2p=p2p)
    training_like_step()
    return "trained on"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_training_step_after_sampling_sends_its_own_shapes():
    assert run_ranks(_training_after_sampling_worker, 2, timeout=60) == ["trained on"] * 2


@pytest.mark.parametrize("prompts,kwargs,problem", [
    ([], {}, "prompts of at least one token id each"),
    ([[1], []], {}, "prompts of at least one token id each"),
    ([[1, 50]], {}, r"prompt ids \[50\] are outside the model's vocabulary \[0, 50\)"),
    ([[-1]], {}, "outside the model's vocabulary"),
    ([[1]], {"max_new_tokens": -1}, "max_new_tokens >= 0"),
    ([[1]], {"cuda_graph": True}, "needs the KV cache, a CUDA device and pp=1"),
    ([[1]], {"compile": True, "use_cache": False}, "a compiled decode step needs the KV cache and pp=1"),
])
def test_bad_input_is_refused_naming_it(prompts, kwargs, problem):
    topo = Topology.build()
    with pytest.raises(ValueError, match=problem):
        generate(_chunks(topo), prompts, kwargs.pop("max_new_tokens", 2), topo=topo, **kwargs)


@pytest.mark.parametrize("kwargs,problem", [({"top_k": -1}, "top_k >= 0"), ({"temperature": float("nan")},
                                            "temperature >= 0"), ({"top_p": 0.0}, "0 < top_p <= 1")])
def test_bad_sampling_settings_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        Sampling(**kwargs)


def test_the_model_is_put_back_in_training_mode_after_an_error(monkeypatch):
    from tessera.inference import generate as module

    topo = Topology.build()
    chunks = _chunks(topo)
    chunks[0].train()
    seen = []

    def failing(*args):
        seen.append(chunks[0].training)
        raise RuntimeError("failed mid-sample")
    monkeypatch.setattr(module, "next_tokens", failing)
    with pytest.raises(RuntimeError, match="failed mid-sample"):
        generate(chunks, [PROMPT], 2, topo=topo)
    assert seen == [False] and chunks[0].training


def test_greedy_sampling_takes_the_most_likely_next_token():
    """Each new id is the argmax of the model's logits at the context's last position."""
    topo = Topology.build()
    (model,) = _chunks(topo)
    (ids,) = generate([model], [PROMPT], 4, topo=topo)
    with torch.no_grad():
        model.eval()
        for n in range(len(PROMPT), len(ids)):
            logits = model(tokens=torch.tensor([ids[:n]]))[:, 0, :CFG.vocab_size]
            assert ids[n] == int(logits[-1].argmax())


def test_top_k_and_top_p_draw_only_among_the_likeliest_tokens():
    """top-k keeps k tokens; top-p the fewest whose probability reaches p (the likeliest always)."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().expand(2000, 4)
    generator = torch.Generator().manual_seed(0)
    drawn = {name: set(next_tokens(logits, s, generator).tolist()) for name, s in (
        ("k2", Sampling(temperature=1.0, top_k=2)), ("p0.7", Sampling(temperature=1.0, top_p=0.7)),
        ("p0.8", Sampling(temperature=1.0, top_p=0.8)), ("p0.81", Sampling(temperature=1.0, top_p=0.81)),
        ("p0.1", Sampling(temperature=1.0, top_p=0.1)), ("all", Sampling(temperature=1.0)))}
    assert drawn == {"k2": {0, 1}, "p0.7": {0, 1}, "p0.8": {0, 1}, "p0.81": {0, 1, 2}, "p0.1": {0},
                     "all": {0, 1, 2, 3}}
    assert next_tokens(torch.tensor([[0.1, 2.0, 2.0]]), Sampling(), None).tolist() == [1]  # (ties: the first)


def test_a_decode_step_over_the_whole_cache_equals_one_over_its_filled_slots():
    """What a CUDA graph replays (attention over every slot, masked to the valid ones: a static
    shape) gives the logits of the eager step (the filled slots only), padded rows included; the
    cache holds each layer's K/V heads only (GQA)."""
    from tessera.models.kv_cache import KVCache

    topo = Topology.build()
    (model,) = _chunks(topo, LLAMA)
    model.eval()
    pads = [2, 0, 4, 3]
    tokens = torch.tensor([[0] * pad + list(range(1, 6 - pad)) for pad in pads])  # [4, 5], left-padded
    logits = {}
    with torch.no_grad():
        for name, end in (("filled", 6), ("whole", None)):
            cache = KVCache.for_chunks([model], batch=4, capacity=9)
            model(tokens, cache=cache.prefill(pads, 5))
            assert sorted(cache.keys) == [0, 1, 2, 3]
            assert cache.keys[0].shape == (4, LLAMA.num_kv_heads, 9, LLAMA.head_dim)
            logits[name] = model(torch.tensor([[7, 8, 9, 10]]), cache=cache.decode(end))
    torch.testing.assert_close(logits["whole"], logits["filled"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_decode_step_draws_what_the_eager_one_draws():
    """The decode step compiled by inductor (attention over the whole capacity, the cache written
    in place; on a CPU, without a CUDA graph) draws the eager step's greedy tokens, prompts of
    different lengths batched, past seq_len; a second call of the same shapes compiles nothing."""
    from torch._dynamo.utils import counters

    cfg = ModelConfig(family="llama", vocab_size=50, hidden=32, heads=4, kv_heads=2, layers=2, seq_len=12,
                      tie_embeddings=False)  # (LLAMA with 2 layers: compiling is the test's time)
    topo = Topology.build()
    chunks = _chunks(topo, cfg)
    new = cfg.seq_len + 3
    eager = generate(chunks, PROMPTS, new, topo=topo)
    assert generate(chunks, PROMPTS, new, topo=topo, compile=True) == eager
    compiled = counters["stats"]["unique_graphs"]
    assert generate(chunks, PROMPTS, new, topo=topo, compile=True) == eager
    assert counters["stats"]["unique_graphs"] == compiled > 0
