"""Does a training step make the host wait for the GPU? Runs the benchmark model's steps with
torch's CUDA sync debug mode on (after warm-up) and prints each synchronising call once, with the
count and the Python frames (inside tessera and benchmarks/) that made it. A host that waits
cannot launch ahead, so the GPU idles for the next launches; pipeline_timeline.py showed hosts
launching a backward at the instant the forward before it ended.
`torchrun --nproc-per-node N benchmarks/sync_probe.py [k=v ...]` (one GPU: `python3 ...`)."""

import collections
import sys
import traceback
import warnings

import torch
from bench_setup import build

from tessera.training.step import train_step

b = build(sys.argv[1:])
seen: collections.Counter = collections.Counter()


def record(message, category, filename, lineno, file=None, line=None) -> None:
    frames = [f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
              if "tessera" in f.filename or "benchmarks" in f.filename]
    seen[(str(message).split("\n")[0][:80], " <- ".join(reversed(frames[-4:])))] += 1


def step():
    mbs = b.data.next()
    return train_step(b.opt, mbs, b.topo, b.stage.executor(len(mbs)), b.dp, clip_grad=1.0, scaler=None)


for _ in range(3):
    step()
torch.cuda.synchronize()
warnings.showwarning = record
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.showwarning = record
    seen.clear()  # the mode's own "prototype feature" warning
    torch.ones((), device="cuda").item()  # the control: one synchronising call the mode must see
    control, _ = sum(seen.values()), seen.clear()
    results = [step() for _ in range(2)]
torch.cuda.set_sync_debug_mode("default")
[r.loss for r in results]  # read the figures after the probe: the trainer reads them one step late
lines = [f"  {n // 2:4d} per step  {m}\n      at {where}" for (m, where), n in seen.most_common()]
print(f"SYNC rank {b.rank} {' '.join(sys.argv[1:])}: {sum(seen.values()) // 2} synchronising calls per step "
      f"(the control .item() {'was' if control else 'was NOT'} seen)\n"
      + "\n".join(lines), flush=True)
for g in b.graphs:
    g.release()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
