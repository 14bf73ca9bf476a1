"""Where a training step's time goes, phase by phase (GPU time from CUDA events, no syncs inside
the step). Run like the trainer: `torchrun --nproc-per-node N benchmarks/profile_step.py [--set k=v ...]`
(defaults: the GPT-1.3B benchmark model, bf16, micro-batch 2, global batch 16).

Prints, on rank 0, the median over steps 3..N of: wall time per step, and the GPU time of
forward+backward, waiting for gradient reductions, finalize + norm + clip, optimizer step.
"""

import statistics
import sys
import time

import torch
from bench_setup import build

from tessera.distributed.finalize import finalize_model_grads
from tessera.optim import clip_coefficient, global_grad_norm

sets = [a for a in sys.argv[1:] if a != "--set"]
b = build(sets)
cfg, rank, world, topo, stage, dp, opt, data = b.cfg, b.rank, b.world, b.topo, b.stage, b.dp, b.opt, b.data
device = topo.device
rows = []
for step in range(10):
    t0 = time.perf_counter()
    mbs = data.next()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    ev[0].record()
    tokens = sum(mb["loss_mask"].sum() for mb in mbs if "loss_mask" in mb).to(device)
    if topo.group("dp") is not None:  # on the step's own dp communicator, as train_step does
        torch.distributed.all_reduce(tokens, group=topo.group("dp_scalars"))
    dp.start_step(len(mbs))
    stage.executor(len(mbs)).run(mbs, tokens, after_comm=getattr(dp, "pipeline_comm_done", None))
    ev[1].record()
    dp.finish_grad_sync()
    ev[2].record()
    grads = opt.grads()
    finalize_model_grads(grads, topo, done=getattr(dp, "tied_reduced", ()))
    coef = clip_coefficient(global_grad_norm(grads, topo, opt.sharded), 1.0)
    ev[3].record()
    opt.step(coef)
    opt.zero_grad()
    ev[4].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows.append([wall] + [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(4)])
if rank == 0 or topo.pp > 1:  # pipeline stages differ: every stage's rank prints
    med = [statistics.median(r[i] for r in rows[2:]) for i in range(5)]
    names = ["wall", "fwd+bwd", "grad-sync wait", "finalize+norm", "optimizer"]
    tok = cfg.train.global_batch * cfg.model.seq_len / world
    print(f"PROFILE rank {rank} world={world} {' '.join(sets)}: "
          + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in zip(names, med))
          + f" -> {tok / med[0]:,.0f} tokens/s per GPU", flush=True)
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
