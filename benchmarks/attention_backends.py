"""Causal attention alone, each SDPA backend on the sweep's shapes: what ``auto``'s attention rule
is measured against, and the kernel's own speed beside a whole training step.

    python3 benchmarks/attention_backends.py [--only NAME[,NAME]] [--repeats 10]

For every shape of benchmarks/sweep.py: q [micro-batch, heads, seq, head_dim], k and v with the
shape's KV heads (grouped-query through ``enable_gqa``), bf16, ``is_causal``; forward alone and
forward + backward, each backend SDPA has (cuDNN, flash, memory-efficient) forced with
``torch.nn.attention.sdpa_kernel`` and SDPA's own choice, timed between CUDA events (median of
``--repeats`` after two untimed runs). TFLOP/s count causal attention's FLOPs as the trainer's
MFU does: forward 2·2·b·heads·s²·d / 2, backward 2.5x that. A backend that refuses a shape
prints why.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import SHAPES  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa's choice": None}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after two untimed ones (CUDA events on
    a GPU, the host's clock elsewhere)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(shape, backend, repeats: int, device: torch.device) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one micro-batch's attention of one layer."""
    b, h, kv, s, d = shape.micro_batch, shape.heads, shape.kv_heads, shape.seq, shape.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(b, kv, s, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    grad = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)

    def both():
        forward().backward(grad)

    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        return timed(forward, repeats, device), timed(both, repeats, device)


def table(shapes, repeats: int, device: torch.device) -> list[str]:
    """The markdown rows: every shape under every backend, or the reason a backend refused it."""
    rows = ["| shape | backend | forward ms | fwd+bwd ms | forward TFLOP/s | backward TFLOP/s |",
            "| --- | --- | --- | --- | --- | --- |"]
    for shape in shapes:
        flops = 2 * 2 * shape.micro_batch * shape.heads * shape.seq ** 2 * shape.head_dim / 2
        for name, backend in BACKENDS.items():
            try:
                fwd, both = measure(shape, backend, repeats, device)
            except RuntimeError as error:  # the backend refuses the shape, dtype or device
                rows.append(f"| {shape.name} | {name} | refused: {str(error).splitlines()[0][:80]} | | | |")
                continue
            rows.append(f"| {shape.name} | {name} | {fwd:.2f} | {both:.2f} | {flops / fwd / 1e9:.0f} | "
                        f"{2.5 * flops / (both - fwd) / 1e9:.0f} |")
            print(rows[-1], file=sys.stderr, flush=True)  # (progress)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated sweep shape names")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    shapes = [s for s in SHAPES if not args.only or s.name in args.only.split(",")]
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}\n")
    print("\n".join(table(shapes, args.repeats, device)))


if __name__ == "__main__":
    main()
