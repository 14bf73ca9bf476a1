"""How fast one micro-batch's weight gradients can be added into fp32 main gradients, one GPU.

Graphed layers at tp=2 leave the weight gradients to autograd (bf16 graph outputs), and
``DataParallel.accumulate`` adds each into its fp32 ``main_grad``: 2,052 ``add_`` per GPT-1.3B
step at tp=2, 34 ms of a 383 ms step on H200 (BENCHMARKS.md, session 9), about a third of the
memory bandwidth those bytes need. An fp32 += bf16 ``add_`` runs PyTorch's unrolled
(dynamic-cast, not vectorised) elementwise kernel. Per way, the time of one layer's adds (GPT-1.3B
at tp=2: QKV, proj, fc1, fc2 weights and their biases, two norms) and the bandwidth it reaches:
``add_`` (today), the same add compiled (inductor: one vectorised kernel with the upcast in
registers, one graph for every length), ``add_(g.float())`` (cast, then a same-dtype add), and
the host time per call of the compiled one (the graphed step's host must stay ahead).
For reference: the fused weight-gradient GEMM (``wgrad_into``, fp32 accumulate inside the GEMM)
against a bf16 GEMM and then the add, for fc1's weight.
`python3 benchmarks/grad_accumulate_probe.py [tp]`."""

import sys
import time

import torch
from comm_bench import cuda_ms

from tessera.tensor_parallel.wgrad import wgrad_into

tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
hidden, ffn, tokens = 2048, 8192, 4096
shapes = [(3 * hidden // tp, hidden), (hidden, hidden // tp), (ffn // tp, hidden), (hidden, ffn // tp),
          (3 * hidden // tp,), (hidden,), (ffn // tp,), (hidden,), (hidden,), (hidden,), (hidden,), (hidden,)]
mains = [torch.zeros(s, device="cuda") for s in shapes]
grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
nbytes = sum(g.numel() * 10 for g in grads)  # read bf16 + read fp32 + write fp32


def cuda_us(run, reps: int = 50) -> float:
    return cuda_ms(run, reps) * 1e3


@torch.compile(dynamic=True)
def compiled_add(main: torch.Tensor, grad: torch.Tensor) -> None:
    main.add_(grad)


ways = {
    "add_ (mixed dtypes)": lambda: [m.add_(g) for m, g in zip(mains, grads)],
    "compiled add (1-D views)": lambda: [compiled_add(m.view(-1), g.view(-1)) for m, g in zip(mains, grads)],
    "add_(g.float())": lambda: [m.add_(g.float()) for m, g in zip(mains, grads)],
    "_foreach_add_": lambda: torch._foreach_add_(mains, grads),
}
for name, run in ways.items():
    for m in mains:
        m.zero_()
    us = cuda_us(run)
    for m in mains:
        m.zero_()
    run()
    exact = all(torch.equal(m, g.float()) for m, g in zip(mains, grads))
    print(f"RESULT {name}: {us:.1f} us per layer ({len(shapes)} tensors), {nbytes / us / 1e3:.0f} GB/s, "
          f"equal to add_: {exact}")

# host time per compiled call (nothing waits for the GPU here)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(200):
    compiled_add(mains[0].view(-1), grads[0].view(-1))
host = (time.perf_counter() - t0) / 200 * 1e6
t0 = time.perf_counter()
for _ in range(200):
    mains[0].add_(grads[0])
eager_host = (time.perf_counter() - t0) / 200 * 1e6
torch.cuda.synchronize()
print(f"RESULT host time per call: compiled {host:.1f} us, eager add_ {eager_host:.1f} us")

# fc1's weight gradient: bf16 GEMM then the add, against the fused fp32-accumulating GEMM
dy = torch.randn(tokens, ffn // tp, device="cuda", dtype=torch.bfloat16)
x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
main = torch.zeros(ffn // tp, hidden, device="cuda")
split = cuda_us(lambda: main.add_(dy.t() @ x))
fused = cuda_us(lambda: wgrad_into(main, dy.t(), x, accumulate=True))
print(f"RESULT fc1 weight gradient: bf16 GEMM + add_ {split:.1f} us, fused fp32-accumulating GEMM {fused:.1f} us")
