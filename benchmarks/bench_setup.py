"""What profile_step.py and kernel_table.py share: the benchmark model (quick_train.py's
GPT-1.3B, bf16, micro-batch 2, global batch 16, synthetic tokens) built as the trainer builds it,
on this torchrun rank."""

import contextlib
import datetime
from types import SimpleNamespace

from quick_train import MODELS  # benchmarks/ is on sys.path when a script here runs

from tessera.config import load_config
from tessera.tensor_parallel import RNGTracker
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed
from tessera.training.launch import init_distributed, pick_device, world_from_env
from tessera.training.cuda_graphs import step_stream
from tessera.training.trainer import Stage, build_data_parallel, check_runnable

MODEL = MODELS["gpt-1.3b"] + ["train.micro_batch=2", "train.global_batch=16", "train.dtype=bf16",
                              "data.source=synthetic"]


def build(sets: list[str]) -> SimpleNamespace:
    """cfg, rank, world, topo, stage, dp (data parallel), opt (optimizer), data (DataFeed), graphs
    (the layers' CUDA graphs where train.cuda_graphs resolves on, as the trainer captures them:
    call ``release()`` on each before destroying the process group)."""
    cfg = load_config(None, MODEL + sets)
    rank, local_rank, world = world_from_env()
    check_runnable(cfg, world)
    device = pick_device("auto", local_rank)
    init_distributed(device, 300)
    p = cfg.parallel
    topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp, device=device, timeout=datetime.timedelta(seconds=300))
    stage = Stage(cfg, topo, RNGTracker.for_rank(1, topo.tp_rank, topo.pp_rank, device))
    dp, opt = build_data_parallel(stage, topo, cfg)
    # graphed layers: captured and run on the step's own stream, as the trainer does, for the
    # rest of the process (the namespace keeps the context: collected, it would be left)
    stream = contextlib.ExitStack()
    if stage.graphed:
        stream.enter_context(step_stream(device))
    graphs = stage.capture_graphs(dp)  # (two sets with micro-batch pairs, as the trainer)
    return SimpleNamespace(cfg=cfg, rank=rank, world=world, topo=topo, stage=stage, dp=dp, opt=opt,
                           data=DataFeed(cfg, topo), graphs=graphs, stream=stream)
