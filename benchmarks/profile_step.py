"""Where a training step's time goes, phase by phase (GPU time from CUDA events, no syncs inside
the step). Run like the trainer: `torchrun --nproc-per-node N benchmarks/profile_step.py [--set k=v ...]`
(defaults: the GPT-1.3B benchmark model, bf16, micro-batch 2, global batch 16).

Prints, on rank 0, the median over steps 3..N of: wall time per step, and the GPU time of
forward+backward, waiting for gradient reductions, finalize + norm + clip, optimizer step.
"""

import datetime
import statistics
import sys
import time

import torch

from tessera.config import load_config
from tessera.distributed.finalize import finalize_model_grads
from tessera.optim import clip_coefficient, global_grad_norm
from tessera.tensor_parallel import RNGTracker
from tessera.topology import Topology
from tessera.training.launch import init_distributed, pick_device, world_from_env
from tessera.training.data_feed import DataFeed
from tessera.training.trainer import Stage, build_data_parallel, check_runnable

MODEL = ["model.family=gpt2", "model.layers=24", "model.hidden=2048", "model.heads=16", "model.seq_len=2048",
         "model.vocab_size=50304", "model.tie_embeddings=true", "train.micro_batch=2", "train.global_batch=16",
         "train.dtype=bf16", "data.source=synthetic"]
sets = [a for a in sys.argv[1:] if a != "--set"]
cfg = load_config(None, MODEL + sets)
rank, local_rank, world = world_from_env()
check_runnable(cfg, world)
device = pick_device("auto", local_rank)
init_distributed(device, 300)
p = cfg.parallel
topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp, device=device, timeout=datetime.timedelta(seconds=300))
stage = Stage(cfg, topo, RNGTracker.for_rank(1, topo.tp_rank, topo.pp_rank, device))
dp, opt = build_data_parallel(stage, topo, cfg)
data = DataFeed(cfg, topo)
rows = []
for step in range(10):
    t0 = time.perf_counter()
    mbs = data.next()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    ev[0].record()
    tokens = sum(mb["loss_mask"].sum() for mb in mbs if "loss_mask" in mb).to(device)
    if topo.group("dp") is not None:
        torch.distributed.all_reduce(tokens, group=topo.group("dp"))
    dp.start_step(len(mbs))
    stage.executor(len(mbs)).run(mbs, tokens)
    ev[1].record()
    dp.finish_grad_sync()
    ev[2].record()
    grads = opt.grads()
    finalize_model_grads(grads, topo)
    coef = clip_coefficient(global_grad_norm(grads, topo, opt.sharded), 1.0)
    ev[3].record()
    opt.step(coef)
    opt.zero_grad()
    ev[4].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows.append([wall] + [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(4)])
if rank == 0:
    med = [statistics.median(r[i] for r in rows[2:]) for i in range(5)]
    names = ["wall", "fwd+bwd", "grad-sync wait", "finalize+norm", "optimizer"]
    tok = cfg.train.global_batch * cfg.model.seq_len / world
    print(f"PROFILE world={world} {' '.join(sets)}: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in zip(names, med))
          + f" -> {tok / med[0]:,.0f} tokens/s per GPU", flush=True)
torch.distributed.destroy_process_group()
