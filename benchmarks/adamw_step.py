"""The fused AdamW step's time by how it is called: parameters as separate tensors or views of one
flat buffer (tessera's main parameters), with or without ``grad_scale`` and ``found_inf`` (how
tessera hands the kernel the clipping factor and the non-finite guard's flag), one or two groups.

    python3 benchmarks/adamw_step.py [--layers 14] [--device cuda]

The parameters are a Llama-3B-like model's (14 layers by default: 2.2B, 35 GB of fp32 parameters,
gradients and moments). Prints ms per step (5 after 2) and the bandwidth of AdamW's 28 bytes per
parameter (read parameter, gradient and two moments; write parameter and moments).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch


def shapes(layers: int, hidden: int = 3072, kv: int = 1024, ffn: int = 8192, vocab: int = 128256) -> list[tuple]:
    out = []
    for _ in range(layers):
        out += [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return out + [(vocab, hidden), (vocab, hidden), (hidden,)]


def parameters(sizes: list[tuple], flat: bool, device: str) -> list[torch.nn.Parameter]:
    n = sum(torch.Size(s).numel() for s in sizes)
    if flat:
        p, g, ps, gs, o = torch.randn(n, device=device), torch.randn(n, device=device) * 1e-3, [], [], 0
        for s in sizes:
            k = torch.Size(s).numel()
            ps.append(torch.nn.Parameter(p[o:o + k].view(s)))
            gs.append(g[o:o + k].view(s))
            o += k
    else:
        ps = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
        gs = [torch.randn(s, device=device) * 1e-3 for s in sizes]
    for p, g in zip(ps, gs):
        p.grad = g
    return ps


def time_step(sizes: list[tuple], flat: bool, scaled: bool, groups: bool, device: str, steps: int = 5) -> float:
    """ms per fused AdamW step."""
    ps = parameters(sizes, flat, device)
    params = ([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
               {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}] if groups else ps)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    if scaled:
        opt.grad_scale = torch.tensor(1.0, device=device)
        opt.found_inf = torch.tensor(0.0, device=device)
    for _ in range(2):
        opt.step()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / steps
    else:
        ms = (time.perf_counter() - t0) * 1e3 / steps
    del opt, ps
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sizes = shapes(args.layers) if args.layers else shapes(1, 64, 16, 128, 256)
    n = sum(torch.Size(s).numel() for s in sizes)
    print(f"{n / 1e9:.2f}B params", flush=True)
    for flat, scaled, groups in [(False, False, False), (True, False, False), (False, True, False),
                                 (False, False, True), (True, True, True), (False, False, False)]:
        ms = time_step(sizes, flat, scaled, groups, args.device)
        print(f"flat={flat} grad_scale+found_inf={scaled} two_groups={groups}: {ms:.2f} ms/step, "
              f"{28 * n / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
