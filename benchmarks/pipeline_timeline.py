"""Where a pipeline step's time goes, per rank, without a profiler (which slows the host enough to
change what it measures): CUDA events around every F / B / I / W action of one step, after
warm-up. Prints each action's GPU start and length and its host launch time, both in ms from the
step's start on the GPU (a negative launch time: the host was that far ahead), then what the
step's GPU time is made of: the actions' own time, the waits inside them (an action on the
critical path that starts late, or runs long while it waits for its received input), gaps
between actions, and the tail (gradient finalisation and the optimizer).
The traced step follows an untraced one launched without synchronising, as in training, so the
host starts it as far ahead as training's host would (until session 10 the tool synchronised
right before the traced step, which made its first forward wait for the host's launches).
The two clocks are tied by an event recorded on an idle GPU before the untraced step.
`torchrun --nproc-per-node 2 benchmarks/pipeline_timeline.py parallel.pp=2 [k=v ...]`."""

import cProfile
import io
import os
import pstats
import sys
import time

import torch
from bench_setup import build

from tessera.training import step as step_module
from tessera.training.step import train_step

b = build(sys.argv[1:])
rank, topo, stage, dp, opt, data = b.rank, b.topo, b.stage, b.dp, b.opt, b.data


def step():
    mbs = data.next()
    executor = stage.executor(len(mbs))
    return executor, train_step(opt, mbs, topo, executor, dp, clip_grad=1.0, scaler=None)


def timed_tail() -> tuple[list, list]:
    """Wrap the calls a step makes after its last pipeline action (train_step's tail) so each
    records a CUDA event as it is entered and left. Returns the list the events go into,
    [(label, start, end)] as the step runs, and the patches to undo."""
    events, patches = [], []

    def wrap(owner, name, label):
        if not hasattr(owner, name):  # e.g. FSDP (zero=3) has no parameter gathers to start
            return
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(*args, **kwargs)
            end.record()
            events.append((label, start, end))
            return out
        setattr(owner, name, timed)
        patches.append((owner, name, original))

    wrap(dp, "finish_grad_sync", "wait for / finish the gradient reductions")
    wrap(opt, "grads", "point the main params at the reduced grads")
    wrap(step_module, "finalize_model_grads", "finalize_model_grads (TP / embedding sums)")
    wrap(step_module, "global_grad_norm", "global gradient norm")
    wrap(getattr(opt, "inner", None), "step", "AdamW")
    wrap(opt, "_copy_to_model", "copy the fp32 main params into the model")
    wrap(dp, "start_param_gather", "launch the parameter all-gathers (they run on NCCL's stream)")
    return events, patches


for _ in range(4):
    step()
torch.cuda.synchronize()
if torch.distributed.is_initialized():  # one GPU runs without a process group
    torch.distributed.barrier()
anchor = torch.cuda.Event(enable_timing=True)  # GPU idle: its time is the host's t0
anchor.record()
t0 = time.perf_counter()
step()  # the untraced step: the traced one starts with the host as far ahead as in training
begin = torch.cuda.Event(enable_timing=True)
begin.record()  # the end of the untraced step's work on the GPU: the traced step's start
mbs = data.next()
executor = stage.executor(len(mbs))
executor.trace = []
tail_events, patches = timed_tail()
train_step(opt, mbs, topo, executor, dp, clip_grad=1.0, scaler=None)
host_end = time.perf_counter()
for owner, name, original in patches:
    setattr(owner, name, original)
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
host_spans = [b_[3] - a_[3] for a_, b_ in zip(trace, trace[1:])] + [host_end - trace[-1][3]]
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
print(f"TIMELINE rank {rank} ({topo.pp_rank=}) {' '.join(sys.argv[1:])}\n" + "\n".join(lines) + "\n"
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
    step()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    body = text.getvalue()
    print(f"HOST rank {rank}: one step under cProfile, by own time\n" + body[body.find("   ncalls"):], flush=True)
for g in b.graphs:
    g.release()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
