"""One micro-batch's embedding gradient into the fp32 main gradient, four ways, on uniform and
Zipf-distributed token ids (real text repeats its frequent tokens thousands of times a batch).

    python3 benchmarks/embedding_grad.py [--device cuda] [--tokens 4096] [--hidden 3072] [--vocab 128256]

dense: PyTorch's embedding backward into a 16-bit [vocab, hidden] gradient, then added into the
main gradient (what autograd and the gradient buffer do without embedding gradient fusion).
scatter: every looked-up row scatter-added into the main gradient (``index_add_``: atomic adds,
so the order of a row's adds varies from run to run). sorted: the same through ``index_put_``
with accumulation (sorted, deterministic; one id's repeats added one after another). sums: each
distinct id's rows summed first (``lookup_row_sums``), one add per distinct row (what tessera's
fused lookup does). Prints ms per micro-batch and checks that the ways agree.
"""

from __future__ import annotations

import argparse
import time

import torch

from tessera.tensor_parallel.layers import lookup_row_sums


def token_ids(n: int, vocab: int, zipf: bool, generator: torch.Generator) -> torch.Tensor:
    """``n`` ids, uniform or Zipf (P(rank k) ~ 1 / k^1.1, the most frequent ids the smallest)."""
    if not zipf:
        return torch.randint(0, vocab, (n,), generator=generator)
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.1)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


def dense(ids, grad, main):
    main.add_(torch.ops.aten.embedding_dense_backward(grad, ids, main.shape[0], -1, False))


def scatter(ids, grad, main):
    main.index_add_(0, ids, grad.float())


def sorted_rows(ids, grad, main):
    main.index_put_((ids,), grad.float(), accumulate=True)


def sums(ids, grad, main):
    rows, table = lookup_row_sums(ids, grad, main.shape[0])
    main.index_put_((rows,), table, accumulate=True)


WAYS = {"dense": dense, "scatter": scatter, "sorted": sorted_rows, "sums": sums}


def time_way(way, ids, grad, main, reps: int) -> float:
    """ms per call of ``way`` after two warm-up calls."""
    cuda = main.is_cuda
    for _ in range(2):
        way(ids, grad, main)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        way(ids, grad, main)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for zipf in (False, True):
        ids = token_ids(args.tokens, args.vocab, zipf, g).to(args.device)
        grad = (torch.randn(args.tokens, args.hidden, generator=g) * 1e-3).to(args.device, torch.bfloat16)
        results = {}
        for name, way in WAYS.items():
            main_grad = torch.zeros(args.vocab, args.hidden, device=args.device)
            ms = time_way(way, ids, grad, main_grad, args.reps)
            main_grad.zero_()
            way(ids, grad, main_grad)
            results[name] = (ms, main_grad)
        reference = results["scatter"][1]
        # the dense way rounds each row's sum to 16 bits once (on a CPU, every add): 1 % in norm
        agree = all((m - reference).norm() <= 1e-2 * reference.norm() for _, m in results.values())
        print(f"{'zipf' if zipf else 'uniform'} ids, {ids.unique().numel()} distinct of {args.tokens}: "
              + ", ".join(f"{name} {ms:.3f} ms" for name, (ms, _) in results.items())
              + ("" if agree else "; THE WAYS DISAGREE"), flush=True)


if __name__ == "__main__":
    main()
