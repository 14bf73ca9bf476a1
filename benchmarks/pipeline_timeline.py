"""Where a pipeline step's time goes, per rank, without a profiler (which slows the host enough to
change what it measures): CUDA events around every F / B / I / W action of one step, after
warm-up. Prints each action's GPU start and length and its host launch time, both in ms from the
step's start on the GPU (a negative launch time: the host was that far ahead), then what the
step's GPU time is made of: the actions' own time, the waits inside them (an action on the
critical path that starts late, or runs long while it waits for its received input), gaps
between actions, and the tail (gradient finalisation and the optimizer), split into its calls.
The traced step follows an untraced one launched without synchronising, as in training, so the
host starts it as far ahead as training's host would (a synchronised start makes the first
forwards wait for the host's launches); the two clocks are tied by an event recorded on an idle
GPU. Also runs at pp=1 (one GPU, dp=2: a step's first forward, last backward and tail).

    torchrun --nproc-per-node 2 benchmarks/pipeline_timeline.py [MODEL] parallel.pp=2 [section.key=value ...]

HOST_PROFILE=0 leaves out the last part: one more step under cProfile, by own time.
"""

import cProfile
import io
import itertools
import os
import pstats
import sys
import time

import torch
from bench_setup import setup, timed_calls

from tessera.training import step as step_module

bench = setup(sys.argv[1:])
rank, topo, parts = bench.rank, bench.topo, bench.parts
dp, opt = parts.data_parallel, parts.optimizer
TAIL = [(dp, "finish_grad_sync", "wait for / finish the gradient reductions"),
        (opt, "grads", "point the main params at the reduced grads"),
        (step_module, "finalize_model_grads", "finalize_model_grads (TP / embedding sums)"),
        (step_module, "grad_norm_and_nonfinite", "global gradient norm"),
        (getattr(opt, "inner", None), "step", "AdamW"),
        (opt, "_copy_to_model", "copy the fp32 main params into the model"),
        (dp, "start_param_gather", "launch the parameter all-gathers (they run on NCCL's stream)")]

for _ in range(4):
    bench.step()
torch.cuda.synchronize()
if torch.distributed.is_initialized():  # one GPU runs without a process group
    torch.distributed.barrier()
anchor = torch.cuda.Event(enable_timing=True)  # GPU idle: its time is the host's t0
anchor.record()
t0 = time.perf_counter()
bench.step()  # the untraced step: the traced one starts with the host as far ahead as in training
begin = torch.cuda.Event(enable_timing=True)
begin.record()  # the end of the untraced step's work on the GPU: the traced step's start
micro_batches = bench.data.next()
executor = parts.executor(len(micro_batches))  # the one the step runs
executor.trace = []
with timed_calls(TAIL) as tail_events:
    bench.step(micro_batches)
host_end = time.perf_counter()
end = torch.cuda.Event(enable_timing=True)
end.record()
torch.cuda.synchronize()
executor.trace, trace = None, executor.trace
shift = anchor.elapsed_time(begin)  # ms from the anchor to the traced step's start, on the GPU


def host_ms(t: float) -> float:
    """A host time in ms from the traced step's start on the GPU."""
    return (t - t0) * 1e3 - shift


lines, busy, previous_end = [], 0.0, None
gaps = 0.0
# the host's time per action: from its launch to the next action's (for the last, to the end of
# the step's launches: the tail's included)
host_spans = [b_[3] - a_[3] for a_, b_ in itertools.pairwise(trace)] + [host_end - trace[-1][3]]
for (op, mb, chunk, launched, s, e), span in zip(trace, host_spans):
    start, stop = begin.elapsed_time(s), begin.elapsed_time(e)
    if previous_end is not None:  # the time before the first action is reported on its own
        gaps += max(0.0, start - previous_end)
        previous_end = max(previous_end, stop)
    else:
        previous_end = stop
    busy += stop - start
    lines.append(f"  {op}{mb}.{chunk}: gpu {start:7.1f} +{stop - start:5.1f}   host launch {host_ms(launched):7.1f}"
                 f" +{span * 1e3:5.1f}")
lines[-1] += " (to the end of the step's launches)"
total = begin.elapsed_time(end)
print(f"TIMELINE rank {rank} ({topo.pp_rank=}) {' '.join(bench.overrides)}\n" + "\n".join(lines) + "\n"
      f"SUMMARY rank {rank}: step {total:.1f} ms on the GPU (host done launching at {host_ms(host_end):.1f}); "
      f"actions {busy:.1f} ms (waits for received inputs included), gaps between actions {gaps:.1f} ms, "
      f"before the first {begin.elapsed_time(trace[0][4]):.1f} ms, after the last (finalise, optimizer) "
      f"{total - previous_end:.1f} ms", flush=True)
tail = [f"  {label}: gpu {begin.elapsed_time(a):7.1f} +{a.elapsed_time(z):5.1f}" for label, a, z in tail_events]
print(f"TAIL rank {rank}: the step's calls after its last action (nested calls overlap their caller's time)\n"
      + "\n".join(tail), flush=True)
if os.environ.get("HOST_PROFILE", "1") != "0":
    # where the host's time goes in one more step (cProfile slows Python, so this step is not the
    # one timed above): a call that blocks on the GPU shows up as a C function with a large own time
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    bench.step()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    body = text.getvalue()
    print(f"HOST rank {rank}: one step under cProfile, by own time\n" + body[body.find("   ncalls"):], flush=True)
bench.close()
