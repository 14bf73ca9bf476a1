"""Would splitting a micro-batch in two, each half on its own CUDA stream with its own TP
communicator, hide one half's sequence-parallel collectives behind the other half's GEMMs at
tp=2? Inside graphed layers the collectives run back to back with the GEMMs on one stream
(BENCHMARKS.md, session 6), so tp=2 sits at ~0.72 of one GPU; this measures the room before
building it into the trainer. GPT-1.3B layers (hidden 2048, seq 2048), tp=2 + SP, bf16, CUDA
graphs per layer as the trainer captures them. Forward + backward of the layer stack for:
  full        micro-batch 2, one stream (what the trainer runs now)
  halves      two micro-batches of 1, one after the other on one stream
  concurrent  the two halves on two streams, layer by layer interleaved, each half's TP
              collectives on its own communicator
  pair        two whole micro-batches of 2 (the GEMMs keep their size), one after the other
  pair-concurrent  the same two on two streams, layer by layer interleaved, each on its own
              communicator (session 8: halves concurrent took 1.50x the full micro-batch; do
              whole micro-batches, whose GEMMs are not cut, hide each other's collectives?)
`torchrun --nproc-per-node 2 benchmarks/tp_two_stream_probe.py [layers] [k=v ...]`; on CPU (gloo)
it runs eagerly with a small model as a check of the script itself (`model.hidden=64 ...`)."""

import contextlib
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from quick_train import MODELS

from tessera.config import load_config
from tessera.models import GPTModel, TPContext
from tessera.topology import Topology
from tessera.training.cuda_graphs import graph_layers

rank = int(os.environ["RANK"])
cuda = torch.cuda.is_available()
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                        timeout=datetime.timedelta(seconds=60))
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = load_config(None, MODELS["gpt-1.3b"] + [f"model.layers={layers}"] + sys.argv[2:]).model
dtype = torch.bfloat16 if cuda else torch.float32
topo = Topology.build(tp=2, device=device, timeout=datetime.timedelta(seconds=120))
second_tp = topo.new_groups(topo.all_ranks_along("tp"))  # the second half's own communicator
seq = cfg.seq_len // 2  # this rank's share under sequence parallelism


def stack(group, micro_batch: int):
    model = GPTModel(cfg, TPContext(group=group, sequence_parallel=True)).to(device=device, dtype=dtype)
    model.init_weights(1)
    graphs = graph_layers(model, micro_batch, seq) if cuda else None
    return list(model.layers.values()), graphs


def stream():
    return torch.cuda.Stream() if cuda else None


def on(s):
    return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()


def sync():
    if cuda:
        torch.cuda.synchronize()


captured = []  # every stack's graphs: released before the process group goes, even after a failure


def graphed_stack(group, micro_batch: int):
    layers_, graphs = stack(group, micro_batch)
    if graphs is not None:
        captured.append(graphs)
    return layers_


x_full = torch.randn(seq, 2, cfg.hidden, device=device, dtype=dtype)
x_a, x_b = x_full[:, :1].contiguous(), x_full[:, 1:].contiguous()
s_a, s_b = stream(), stream()


def run_full():
    h = x_full.detach().requires_grad_()
    for layer in full:
        h = layer(h)
    h.backward(torch.ones_like(h))


def run_halves():
    for x, stack_ in ((x_a, half_a), (x_b, half_b)):
        h = x.detach().requires_grad_()
        for layer in stack_:
            h = layer(h)
        h.backward(torch.ones_like(h))


def run_pair():
    for stack_ in (full, full_b):
        h = x_full.detach().requires_grad_()
        for layer in stack_:
            h = layer(h)
        h.backward(torch.ones_like(h))


def run_concurrent(a=None, b=None, xa=None, xb=None):
    a, b = a or half_a, b or half_b
    xa, xb = (x_a, x_b) if xa is None else (xa, xb)
    if cuda:
        s_a.wait_stream(torch.cuda.current_stream())
        s_b.wait_stream(torch.cuda.current_stream())
    with on(s_a):
        h_a = xa.detach().requires_grad_()
    with on(s_b):
        h_b = xb.detach().requires_grad_()
    for layer_a, layer_b in zip(a, b):  # layer by layer, each on its stream
        with on(s_a):
            h_a = layer_a(h_a)
        with on(s_b):
            h_b = layer_b(h_b)
    with on(s_a):
        g_a_out = torch.ones_like(h_a)
    with on(s_b):
        g_b_out = torch.ones_like(h_b)
    torch.autograd.backward([h_a, h_b], [g_a_out, g_b_out])  # each node's backward runs on its forward's stream
    if cuda:
        torch.cuda.current_stream().wait_stream(s_a)
        torch.cuda.current_stream().wait_stream(s_b)


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


try:
    full = graphed_stack(topo.group("tp"), 2)
    half_a = graphed_stack(topo.group("tp"), 1)
    half_b = graphed_stack(second_tp, 1)
    full_b = graphed_stack(second_tp, 2)
    where = torch.cuda.get_device_name() if cuda else "CPU (a check of the script, not a figure)"
    results = {}
    for name, fn in (("full", run_full), ("halves", run_halves), ("concurrent", run_concurrent),
                     ("pair", run_pair), ("pair-concurrent", lambda: run_concurrent(full, full_b, x_full, x_full))):
        results[name] = timed(fn)
        if rank == 0:  # as it comes: a later hang must not lose what was measured
            what = "two micro-batches" if name.startswith("pair") else "one micro-batch"
            print(f"RESULT {layers} GPT-1.3B layers at tp=2 + SP, forward + backward of {what} of 2, "
                  f"{where}: {name} {results[name]:.2f} ms", flush=True)
    if rank == 0:
        print(f"RESULT concurrent / full {results['concurrent'] / results['full']:.3f}, "
              f"halves / full {results['halves'] / results['full']:.3f}, "
              f"pair-concurrent / pair {results['pair-concurrent'] / results['pair']:.3f}", flush=True)
except BaseException:
    traceback.print_exc()
    for g in captured:  # graphs holding NCCL work would hang the exit
        g.release()
    sys.stdout.flush()
    os._exit(1)
for g in captured:
    g.release()
dist.barrier()
dist.destroy_process_group()
