"""Where a training step's time goes, phase by phase: GPU time between CUDA events recorded as the
step enters and leaves its phases (no synchronisation inside the step), over 10 steps.

    torchrun --nproc-per-node N benchmarks/profile_step.py [MODEL] [section.key=value ...]

Prints, on rank 0 (every rank at pp > 1: the stages differ), the median over steps 3-10 of: the
wall time per step (the host waits for the GPU after each step, so the host's lead is lost) and
the GPU time of forward + backward (the pipeline's actions included), the wait for the gradient
reductions (``finish_grad_sync``), finalize + gradient norm, and the optimizer step (with zero 1-2
the parameter gathers' launch); then the tokens/s per GPU that the wall time gives.
"""

import statistics
import sys
import time

import torch
from bench_setup import setup, timed_calls

NAMES = ["wall", "fwd+bwd", "grad-sync wait", "finalize+norm", "optimizer"]


def main() -> None:
    bench = setup(sys.argv[1:])
    parts, cfg = bench.parts, bench.cfg
    rows = []
    calls = [(parts.data_parallel, "finish_grad_sync", "sync"), (parts.optimizer, "step", "optimizer")]
    for _ in range(10):
        t0 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        with timed_calls(calls) as events:
            bench.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        (_, sync_in, sync_out), (_, opt_in, opt_out) = events
        rows.append([wall * 1e3, start.elapsed_time(sync_in), sync_in.elapsed_time(sync_out),
                     sync_out.elapsed_time(opt_in), opt_in.elapsed_time(opt_out)])
    if bench.rank == 0 or bench.topo.pp > 1:
        med = [statistics.median(r[i] for r in rows[2:]) for i in range(len(NAMES))]
        tokens = cfg.train.global_batch * cfg.model.seq_len / bench.world
        print(f"PROFILE rank {bench.rank} world={bench.world} {' '.join(bench.overrides)}: "
              + ", ".join(f"{n} {v:.1f} ms" for n, v in zip(NAMES, med))
              + f" -> {tokens / med[0] * 1e3:,.0f} tokens/s per GPU", flush=True)
    bench.close()


if __name__ == "__main__":
    main()
