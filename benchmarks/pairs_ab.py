"""Micro-batch pairs' executor settings against each other in one process (one capture, the
same GPUs, rounds interleaved so drift spreads evenly): the second backward's gradient adds on
the side stream (``PairedExecutor.side_adds``, SETTINGS="0 1") or not, and the two backwards
issued by one thread piece by piece in turn (``PairedExecutor.backward_in_turn``, setting "turn"). Prints each setting's
median ms per step and tokens/s per GPU. Run like the trainer: `torchrun --nproc-per-node 2 benchmarks/pairs_ab.py [k=v ...]` (GPT-1.3B benchmark
model; pairs need tp > 1 and, since session 19, opting in: e.g. parallel.tp=2
parallel.sequence_parallel=true parallel.tp_microbatch_pairs=true). EACH_STEP=1 prints each
step as it starts and DUMP_AFTER=S dumps every thread's stack where a step runs S seconds (a
hang's place). ORDER_LOG=1 writes, per rank, the order the step's backward replayed the CUDA graphs
in (each graph named by its capture order, the same on every rank) to $OUT/replays_rank<r>.txt, a
line per step written as the backward's issue ends: the two backwards are issued by autograd's one
device thread, taking nodes of two graph tasks that two host threads start, so their order may
differ between the ranks, and with it the order of the two communicators' collectives."""

import faulthandler
import os
import statistics
import sys
import time

import torch
from bench_setup import build

from tessera.training.concurrent import PairedExecutor
from tessera.training.step import train_step

DUMP_AFTER = float(os.environ.get("DUMP_AFTER", "0"))  # (set again at each step: seconds without progress)
ORDER_LOG = bool(os.environ.get("ORDER_LOG"))
names, replays = {}, []  # ORDER_LOG: a graph's capture index by id; this step's replays
if ORDER_LOG:  # (before the capture: graphs are named as they are first captured)
    from torch.cuda.graphs import CUDAGraph
    capture_begin, replay = CUDAGraph.capture_begin, CUDAGraph.replay

    def named_capture_begin(self, *args, **kwargs):
        names.setdefault(id(self), len(names))
        return capture_begin(self, *args, **kwargs)

    def logged_replay(self):
        replays.append(names.get(id(self), -1))
        return replay(self)
    CUDAGraph.capture_begin, CUDAGraph.replay = named_capture_begin, logged_replay
b = build(sys.argv[1:])
rank, topo, stage, dp, opt, data = b.rank, b.topo, b.stage, b.dp, b.opt, b.data
executor = stage.executor(len(data.next()))
if not isinstance(executor, PairedExecutor):
    raise SystemExit("pairs_ab.py: these settings do not run micro-batch pairs (parallel.tp_microbatch_pairs)")
if ORDER_LOG:  # the backward's replays, a line per step, written as its issue ends (also in a hang)
    order_file = open(os.path.join(os.environ.get("OUT", "/tmp"), f"replays_rank{rank}.txt"), "w")
    def logged(backwards):
        def run(*args):
            start = len(replays)
            out = backwards(*args)
            order_file.write(" ".join(map(str, replays[start:])) + "\n")
            order_file.flush()
            return out
        return run
    executor._backwards = logged(executor._backwards)
    executor._backwards_in_turn = logged(executor._backwards_in_turn)
# 0: the backwards from two threads; 1: the same with side adds; turn: one thread, in turn
SETTINGS = os.environ.get("SETTINGS", "0 1").split()
if not SETTINGS or set(SETTINGS) - {"0", "1", "turn"}:
    raise SystemExit(f"pairs_ab.py: SETTINGS takes 0, 1 and turn, not {SETTINGS}")


def use(setting: str) -> None:
    executor.side_adds, executor.backward_in_turn = setting == "1", setting == "turn"
STEPS, ROUNDS = int(os.environ.get("STEPS", "6")), int(os.environ.get("ROUNDS", "3"))
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # (a CPU smoke run)
TOKENS = b.cfg.train.global_batch * b.cfg.model.seq_len  # a step's, over every rank


done = [0]


def step():
    if DUMP_AFTER:  # every thread's stack to stderr where a step takes longer (a hang's place)
        faulthandler.dump_traceback_later(DUMP_AFTER)
    if rank == 0 and os.environ.get("EACH_STEP"):  # where a hang comes
        print(f"step {done[0]}", flush=True)
    done[0] += 1
    if ORDER_LOG:
        order_file.write(f"step {done[0] - 1}\n")
        replays.clear()
    train_step(opt, data.next(), topo, executor, dp, clip_grad=1.0, scaler=None)


use(SETTINGS[0])  # (the warm-up steps too: a hang count of one setting runs only it)
for _ in range(3):
    step()
times = {s: [] for s in SETTINGS}
for _ in range(ROUNDS):
    for s in SETTINGS:
        use(s)
        step()
        sync()
        for _ in range(STEPS):
            t0 = time.perf_counter()
            step()
            sync()
            times[s].append(time.perf_counter() - t0)
        if rank == 0:
            print(f"setting {s}: {len(times[s])} steps timed", flush=True)
if rank == 0:
    for side, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"PAIRS setting {side}: {ms:.1f} ms/step median "
              f"({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}), {TOKENS / (ms / 1e3) / b.world:,.0f} tokens/s per GPU",
              flush=True)
faulthandler.cancel_dump_traceback_later()
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
