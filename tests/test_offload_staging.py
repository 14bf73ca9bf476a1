"""parallel.offload_staging: the offloaded optimizer brings gradients to the host span by span
through two bounded pinned buffers (optim/offload.py). Spans smaller than a range train to the
same bits as whole ranges, and the host holds 12 bytes per optimizer element plus the buffers,
as the memory model predicts to the byte."""

from __future__ import annotations

import functools

import pytest
import torch

from tessera.config import ConfigError, load_config
from tessera.optim.offload import staging_buffers, staging_spans
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.memory_model import model_state
from tessera.training.preflight import validate
from training_runs import BASE, train_run

LAYOUTS = [(zero, dtype) for zero in (0, 1) for dtype in ("fp32", "bf16")]
BUCKETS = "parallel.bucket_size=20000"  # ranges of several parameters each
SMALL = 5000  # elements: a fraction of a range, above the largest parameter (4096)


def _worker(rank: int, world: int) -> dict:
    out = {}
    for zero, dtype in LAYOUTS:
        for staging in (0, SMALL):
            sets = [f"parallel.zero={zero}", f"train.dtype={dtype}", "parallel.optimizer_offload=true",
                    f"parallel.offload_staging={staging}", BUCKETS]
            seen = {}

            def look(stage, _, seen=seen):  # what the optimizer holds on the host
                opt = stage.optimizer
                seen.update(mains=sum(m.numel() for m in opt.mains), buffers=[b.numel() for b in opt.staging],
                            spans=[b - a for _, a, b, _ in opt.spans], ranges=[m.numel() for m in opt.mains],
                            largest=max(t.numel() for t, *_ in opt.pieces))

            topo = Topology.build()
            run = train_run(topo, sets, prepare=look)
            cfg = validate(load_config(None, BASE + sets), world)
            run["predicted"] = model_state(cfg, topo.pp_rank, topo.dp_rank)
            run["elements"] = run["state_bytes"] // 8
            run.update(seen)
            out[(zero, dtype, staging)] = run
    return out


@functools.cache
def runs() -> list[dict]:
    return run_ranks(_worker, 2, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("zero,dtype", LAYOUTS)
def test_smaller_spans_train_to_the_same_bits(zero, dtype):
    for rank in runs():
        whole, parts = rank[(zero, dtype, 0)], rank[(zero, dtype, SMALL)]
        assert parts["losses"] == whole["losses"] and parts["norms"] == whole["norms"]
        for name, value in whole["params"].items():
            assert torch.equal(parts["params"][name], value), name


@pytest.mark.slow
def test_host_memory_is_12_bytes_per_element_plus_the_staging_buffers():
    for rank in runs():
        for zero, dtype in LAYOUTS:
            whole, parts = rank[(zero, dtype, 0)], rank[(zero, dtype, SMALL)]
            for run in (whole, parts):
                assert run["memory"] == run["predicted"], (zero, dtype)  # to the byte
                # main parameters (each range, padding included) and Adam's moments, then the buffers
                buffers = 4 * sum(run["buffers"])
                assert run["memory"].host == 4 * run["mains"] + 8 * run["elements"] + buffers
                assert run["buffers"] == [max(run["spans"])] * staging_buffers(len(run["spans"]))
                assert run["memory"].host - buffers == pytest.approx(12 * run["elements"], rel=0.05)
            assert max(whole["spans"]) == max(whole["ranges"])  # 0: a whole range
            assert max(parts["spans"]) <= SMALL < max(whole["ranges"]) and len(parts["spans"]) > len(whole["spans"])


def test_spans_cut_at_parameter_starts_and_cover_the_range():
    frags = [(0, 100), (128, 700), (704, 750), (768, 1000)]
    assert staging_spans(1024, frags, 0) == [(0, 1024)] == staging_spans(1024, frags, 1024)
    # a parameter longer than the cap (128..700) is a span of its own (with the padding after it);
    # the rest packs up to the cap, the range's trailing padding with the last
    assert staging_spans(1024, frags, 300) == [(0, 128), (128, 704), (704, 1024)]
    assert staging_spans(1024, frags, 1) == [(0, 128), (128, 704), (704, 768), (768, 1024)]
    assert staging_spans(0, [], 5) == [] and staging_buffers(0) == 0
    assert staging_buffers(1) == 1 and staging_buffers(3) == 2


def test_negative_staging_is_refused_in_words():
    with pytest.raises(ConfigError, match="parallel.offload_staging"):
        load_config(None, ["parallel.offload_staging=-1"])
