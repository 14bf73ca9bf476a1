"""The top GPU kernels of a few training steps (torch.profiler), rank 0, for finding what a layout
spends its time on. Run like the trainer:
`torchrun --nproc-per-node N benchmarks/kernel_table.py [k=v ...]` (GPT-1.3B benchmark model)."""

import datetime
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tessera.config import load_config
from tessera.tensor_parallel import RNGTracker
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed
from tessera.training.launch import init_distributed, pick_device, world_from_env
from tessera.training.step import train_step
from tessera.training.trainer import Stage, build_data_parallel, check_runnable

MODEL = ["model.family=gpt2", "model.layers=24", "model.hidden=2048", "model.heads=16", "model.seq_len=2048",
         "model.vocab_size=50304", "model.tie_embeddings=true", "train.micro_batch=2", "train.global_batch=16",
         "train.dtype=bf16", "data.source=synthetic"]
cfg = load_config(None, MODEL + sys.argv[1:])
rank, local_rank, world = world_from_env()
check_runnable(cfg, world)
device = pick_device("auto", local_rank)
init_distributed(device, 300)
p = cfg.parallel
topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp, device=device, timeout=datetime.timedelta(seconds=300))
stage = Stage(cfg, topo, RNGTracker.for_rank(1, topo.tp_rank, topo.pp_rank, device))
dp, opt = build_data_parallel(stage, topo, cfg)
data = DataFeed(cfg, topo)


def step():
    mbs = data.next()
    train_step(opt, mbs, topo, stage.executor(len(mbs)), dp, clip_grad=1.0, scaler=None)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
if rank == 0:
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
torch.distributed.destroy_process_group()
