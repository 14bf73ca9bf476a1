"""RNGTracker (the default and the per-TP-rank dropout streams) and stable_seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.tensor_parallel import RNGTracker, stable_seed
from tessera.testing import run_ranks

TIMEOUT = 60
SEED = 1234
N = 256  # mask length: two independent p=0.5 masks agree everywhere with probability 2**-256


def _mask() -> list[bool]:
    """A dropout mask drawn from the device's global generator (as dropout in a model does)."""
    return (F.dropout(torch.ones(N), p=0.5, training=True) != 0).tolist()


def _random_rank(rank: int, world_size: int) -> dict:
    tracker = RNGTracker.for_rank(SEED, tp_rank=rank)
    default_1 = _mask()
    with tracker.fork("tp"):
        tp_1 = _mask()
    default_2 = _mask()
    with tracker.fork():  # "tp" is the default name
        tp_2 = _mask()

    # the fork neither consumed nor disturbed the default stream: the same two masks come out of
    # a generator seeded as for_rank seeds the default stream, with no fork in between
    torch.manual_seed(SEED)
    plain = [_mask(), _mask()]
    assert [default_1, default_2] == plain, "fork('tp') disturbed the default stream"

    # a later pipeline stage has another default stream (and another tp stream)
    other_stage = RNGTracker.for_rank(SEED, tp_rank=rank, pp_rank=1)
    stage_default = _mask()
    with other_stage.fork():
        stage_tp = _mask()
    return dict(default=[default_1, default_2], tp=[tp_1, tp_2], stage_default=stage_default,
                stage_tp=stage_tp, seeds=[stable_seed("model", 3), stable_seed("data", "x")])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_stream_differs_across_ranks_and_default_stream_agrees(tp):
    out = run_ranks(_random_rank, tp, timeout=TIMEOUT)
    # the default stream draws the same masks on every TP rank (replicated activations)
    for r in range(1, tp):
        assert out[r]["default"] == out[0]["default"], f"default-stream masks differ on TP rank {r}"
        assert out[r]["stage_default"] == out[0]["stage_default"]
    # the tp stream draws a different mask on every TP rank (TP-split activations)
    for i in range(tp):
        for j in range(i + 1, tp):
            assert out[i]["tp"][0] != out[j]["tp"][0], f"TP ranks {i} and {j} share a dropout mask"
            assert out[i]["tp"][1] != out[j]["tp"][1], f"TP ranks {i} and {j} share a dropout mask"
            assert out[i]["stage_tp"] != out[j]["stage_tp"]
    for o in out:
        # the tp stream is not the default one, and it advances from one fork to the next
        assert o["tp"][0] not in o["default"]
        assert o["tp"][0] != o["tp"][1]
        assert o["default"][0] != o["default"][1]
        # a different pipeline stage gets different streams
        assert o["stage_default"] not in o["default"]
        assert o["stage_tp"] not in o["tp"]
        # masks really are random: about half kept
        assert 0.3 * N < sum(o["tp"][0]) < 0.7 * N and 0.3 * N < sum(o["default"][0]) < 0.7 * N
    # stable_seed gives the same value in every process
    assert all(o["seeds"] == out[0]["seeds"] for o in out)
    assert out[0]["seeds"] == [stable_seed("model", 3), stable_seed("data", "x")]


@pytest.fixture
def restore_global_rng():
    with torch.random.fork_rng(devices=[]):
        yield


def test_get_and_set_states_replay_both_streams(restore_global_rng):
    tracker = RNGTracker.for_rank(SEED, tp_rank=1)
    _mask(), _mask()  # move both streams away from their seeds
    with tracker.fork():
        _mask()
    states = tracker.get_states()
    assert set(states) == {"", "tp"}

    def run():
        a = _mask()
        with tracker.fork():
            b = _mask()
            c = _mask()
        return a, b, c, _mask()

    first = run()
    assert len(set(map(tuple, first))) == 4, "the masks of one run should all differ"
    tracker.set_states(states)
    assert run() == first, "set_states did not restore the streams"
    # the snapshot is a copy: restoring it again replays again
    tracker.set_states(states)
    assert run() == first
    # and the state after a replay equals the state after the first run (nothing was left behind)
    after = tracker.get_states()
    tracker.set_states(states)
    run()
    again = tracker.get_states()
    assert all(torch.equal(after[k], again[k]) for k in after)


def test_fork_restores_default_stream_on_error(restore_global_rng):
    tracker = RNGTracker.for_rank(SEED, tp_rank=0)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.fork():
            _mask()
            raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before), "the default stream was not restored"
    # the tp stream did advance: the next mask is the second one, not the first again
    fresh = RNGTracker.for_rank(SEED, tp_rank=0)
    with fresh.fork():
        fresh_masks = [_mask(), _mask()]
    with tracker.fork():
        assert _mask() == fresh_masks[1]


def test_tracker_stream_names(restore_global_rng):
    tracker = RNGTracker()
    with pytest.raises(KeyError):
        with tracker.fork("tp"):
            pass
    tracker.add("tp", 5)
    with pytest.raises(ValueError):
        tracker.add("tp", 6)
    # adding a stream leaves the default stream where it was
    torch.manual_seed(0)
    expected = _mask()
    torch.manual_seed(0)
    tracker.add("other", 7)
    assert _mask() == expected
    # streams seeded alike draw alike; differently, differently
    a, b = RNGTracker(), RNGTracker()
    a.add("x", 11)
    b.add("x", 11)
    b.add("y", 12)
    with a.fork("x"):
        ma = _mask()
    with b.fork("x"):
        mb = _mask()
    with b.fork("y"):
        mc = _mask()
    assert ma == mb and ma != mc


def test_stable_seed_is_deterministic():
    s = stable_seed("tessera", 42, "layer", 3)
    assert s == stable_seed("tessera", 42, "layer", 3)
    assert isinstance(s, int) and 0 <= s < 2**63
    # parts matter, and so does their order
    assert s != stable_seed("tessera", 42, "layer", 4)
    assert stable_seed("a", "b") != stable_seed("b", "a")
    seeds = {stable_seed("run", i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= x < 2**63 for x in seeds)
    # the same on every machine and Python run: a pinned value (sha256 of "tessera/42/layer/3")
    assert s == 7159718482079090877
    # usable as a torch seed
    torch.Generator().manual_seed(s)
