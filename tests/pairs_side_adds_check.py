"""Run by tests/test_gpu.py under torchrun on 2 GPUs (not collected by pytest): a small GPT at
tp=2 + SP in micro-batch pairs, each step's gradients made with the second backward's adds on
the step's stream and again on the side stream (PairedExecutor.side_adds,
distributed/side_adds.py); the fp32 main gradients must agree to rounding (only the order of a
pair's two adds into one gradient may differ), and the side stream must have taken adds.
`torchrun --nproc-per-node 2 tests/pairs_side_adds_check.py [k=v ...]`; prints SIDE ADDS OK."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_setup import build  # noqa: E402

from tessera.distributed import side_adds  # noqa: E402

SMALL = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.seq_len=64", "model.vocab_size=512",
         "train.dtype=fp32", "train.micro_batch=2", "train.global_batch=8", "parallel.tp=2",
         "parallel.sequence_parallel=true", "parallel.tp_microbatch_pairs=true"]
b = build(SMALL + sys.argv[1:])
executor = b.stage.executor(4)
on_side = [0]
second_add = side_adds.SideAdds.second_add


def counted(self, p):
    if p not in self._on_step:
        on_side[0] += 1
    return second_add(self, p)


side_adds.SideAdds.second_add = counted
for step in range(4):
    mbs = b.data.next()
    global_tokens = sum(mb["loss_mask"].sum() for mb in mbs).to(torch.float32)
    grads = {}
    for side in (False, True):
        executor.side_adds = side
        b.dp.start_step(len(mbs))
        executor.run(mbs, global_tokens)
        b.dp.finish_grad_sync()
        grads[side] = [rng.grad.clone() for rng in b.dp.ranges]
    for i, (g, h) in enumerate(zip(grads[False], grads[True])):
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-7, msg=lambda m, i=i: f"step {step}, range {i}: {m}")
if torch.cuda.is_available():
    assert on_side[0] > 0, "no add ran on the side stream"
print(f"SIDE ADDS OK rank {b.rank}: {on_side[0]} adds on the side stream", flush=True)
for g in b.graphs:  # graphs holding NCCL work would hang the destroy
    g.release()
torch.distributed.destroy_process_group()
