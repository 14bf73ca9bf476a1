"""Where a pipeline step's time goes, per rank, without a profiler (which slows the host enough to
change what it measures): CUDA events around every F / B / I / W action of one step, after
warm-up. Prints each action's GPU start and length and its host launch time (both in ms from
the step's start, with the GPU idle at that start, so the clocks agree), then what the step's
GPU time is made of: the actions' own time, the waits inside them (an action on the critical
path that starts late, or runs long while it waits for its received input), gaps between actions,
and the tail (gradient finalisation and the optimizer).
`torchrun --nproc-per-node 2 benchmarks/pipeline_timeline.py parallel.pp=2 [k=v ...]`."""

import sys
import time

import torch
from bench_setup import build

from tessera.training.step import train_step

b = build(sys.argv[1:])
rank, topo, stage, dp, opt, data = b.rank, b.topo, b.stage, b.dp, b.opt, b.data


def step():
    mbs = data.next()
    executor = stage.executor(len(mbs))
    return executor, train_step(opt, mbs, topo, executor, dp, clip_grad=1.0, scaler=None)


for _ in range(4):
    step()
torch.cuda.synchronize()
if torch.distributed.is_initialized():  # one GPU runs without a process group
    torch.distributed.barrier()
begin = torch.cuda.Event(enable_timing=True)
begin.record()
t0 = time.perf_counter()
mbs = data.next()
executor = stage.executor(len(mbs))
executor.trace = []
train_step(opt, mbs, topo, executor, dp, clip_grad=1.0, scaler=None)
host_end = time.perf_counter()
end = torch.cuda.Event(enable_timing=True)
end.record()
torch.cuda.synchronize()
executor.trace, trace = None, executor.trace

lines, busy, previous_end = [], 0.0, None
gaps = 0.0
for op, mb, chunk, launched, s, e in trace:
    start, stop = begin.elapsed_time(s), begin.elapsed_time(e)
    if previous_end is not None:  # the time before the first action is reported on its own
        gaps += max(0.0, start - previous_end)
        previous_end = max(previous_end, stop)
    else:
        previous_end = stop
    busy += stop - start
    lines.append(f"  {op}{mb}.{chunk}: gpu {start:7.1f} +{stop - start:5.1f}   host launch {(launched - t0) * 1e3:7.1f}")
total = begin.elapsed_time(end)
print(f"TIMELINE rank {rank} ({topo.pp_rank=}) {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n"
      f"SUMMARY rank {rank}: step {total:.1f} ms on the GPU (host done launching at {(host_end - t0) * 1e3:.1f}); "
      f"actions {busy:.1f} ms (waits for received inputs included), gaps between actions {gaps:.1f} ms, "
      f"before the first {begin.elapsed_time(trace[0][4]):.1f} ms, after the last (finalise, optimizer) "
      f"{total - previous_end:.1f} ms", flush=True)
for g in b.graphs:
    g.release()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
