"""Run by tests/test_gpu.py under torchrun on ONE GPU (not collected by pytest): the micro-batch
pairs' CUDA machinery (the side stream, a second communicator, graphed layers captured once per
communicator, the in-turn backward's cut forward and seeded piece backwards) at tp=1, where the
collectives have nothing to do, so one GPU can check it before a 2-GPU machine is lent. The
config refuses pairs at tp=1 (they hide TP collectives, and tp=1 has none): this check forces
them after validation, with a one-rank NCCL group standing for each of the two TP communicators,
only to exercise the streams and graphs. Each step's fp32 main gradients with the two-thread
backwards and with ``backward_in_turn`` must agree with one micro-batch at a time (the plain
executor over the same layers and buffers) to rounding: only the order of a parameter's two
adds may differ. `torchrun --nproc-per-node 1 tests/pairs_in_turn_check.py [k=v ...]`; prints
IN TURN OK."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_setup  # noqa: E402

from tessera.pipeline_parallel.executor import PipelineExecutor  # noqa: E402
from tessera.pipeline_parallel.schedules import build_schedule  # noqa: E402
from tessera.topology import Topology  # noqa: E402

SMALL = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.seq_len=64", "model.vocab_size=512",
         "train.dtype=fp32", "train.micro_batch=2", "train.global_batch=8",
         "train.grad_accum_fusion=false", "train.compile=false"]  # (what auto resolves to at tp > 1)
CUDA = torch.cuda.is_available()  # (on a CPU: gloo, eager layers, no side stream; the script's own check)


def pairs_after_validation(check_runnable):
    def patched(cfg, world_size):
        out = check_runnable(cfg, world_size)
        cfg.parallel.tp_microbatch_pairs, cfg.parallel.tp_pairs_backward = "true", "in_turn"
        return out
    return patched


def with_tp_group(build):
    def patched(*args, **kwargs):
        topo = build(*args, **kwargs)
        topo.groups["tp"] = topo.new_groups([[0]])  # (None at tp=1: the pairs swap one group for another)
        return topo
    return patched


assert int(os.environ["WORLD_SIZE"]) == 1, "one process, one GPU"
if CUDA:
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    SMALL.append("train.cuda_graphs=true")
else:
    dist.init_process_group("gloo")
bench_setup.check_runnable = pairs_after_validation(bench_setup.check_runnable)
Topology.build = with_tp_group(Topology.build)
b = bench_setup.build(SMALL + sys.argv[1:])
GRAPHED = CUDA and "train.cuda_graphs=false" not in sys.argv
assert b.stage.pairs and bool(b.graphs) == GRAPHED, "the pairs or the graphs were not as asked"
executor = b.stage.executor(4)
assert type(executor).__name__ == "PairedExecutor" and (executor.side is not None) == CUDA, type(executor)
actions = build_schedule(b.stage.schedule, 1, 1, 4, 0)
plain = PipelineExecutor(b.stage.chunks, actions, None, 1, 0, b.stage.wgrad_store)
for step in range(3):
    mbs = b.data.next()
    global_tokens = sum(mb["loss_mask"].sum() for mb in mbs).to(torch.float32)
    grads, losses = {}, {}
    for name, ex in (("plain", plain), ("threads", executor), ("in turn", executor)):
        if ex is executor:
            executor.backward_in_turn = name == "in turn"
        b.dp.start_step(len(mbs))
        losses[name] = float(ex.run(mbs, global_tokens))
        b.dp.finish_grad_sync()
        grads[name] = [rng.grad.clone() for rng in b.dp.ranges]
    for name in ("threads", "in turn"):
        assert abs(losses[name] - losses["plain"]) <= 1e-5 * abs(losses["plain"]), (step, name, losses)
        for i, (g, h) in enumerate(zip(grads["plain"], grads[name])):
            torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, i=i, name=name: f"step {step}, {name}, range {i}: {m}")
    assert all(g.abs().sum() > 0 for g in grads["in turn"]), "a gradient range stayed zero"
    print(f"step {step}: loss {losses['plain']:.6f}, the three runs agree", flush=True)
print(f"IN TURN OK: {len(b.graphs)} graph captures, side stream {executor.side}", flush=True)
for g in b.graphs:
    g.release()
dist.destroy_process_group()
