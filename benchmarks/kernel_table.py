"""A step's GPU kernels (torch.profiler over 2 steps after 6): the top kernels on rank 0, and on
every rank how much of a step its GPU is busy, with NCCL, with compute, and with NCCL beside
compute (overlapped communication), per stream. The profiler slows the host, so read busy time,
not idle time.

    torchrun --nproc-per-node N benchmarks/kernel_table.py [MODEL] [section.key=value ...]
    python benchmarks/kernel_table.py --read FILE [--bin MS] [--bins N] [--window START LEN]

With $OUT set, every kernel (start and end in µs from the first, stream, name) goes to
``$OUT/kernels_$KT_TAG_rankR.csv.gz``; ``--read`` prints from such a file the time in each state
(idle, NCCL alone, compute alone, NCCL beside compute, two compute kernels at once) per step and
per time bin, which shows which phase of a step overlaps; ``--window`` lists a stretch's kernels.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import os
import sys
import time

Row = tuple[float, float, int, str]  # start µs, end µs, stream, kernel name


def load(path: str) -> list[Row]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return sorted((float(a), float(b), int(s), n) for a, b, s, n in csv.reader(f))


def _state(nccl: int, compute: int) -> str:
    if nccl and compute:
        return "nccl beside compute"
    if nccl:
        return "nccl alone"
    if compute > 1:
        return "compute x2+"
    return "compute alone" if compute else "idle"


def segments(rows: list[Row]) -> list[tuple[float, float, str]]:
    """The timeline cut where any kernel starts or ends: (start, end, state) in µs."""
    events = []
    for a, b, _, name in rows:
        kind = "nccl" if "nccl" in name.lower() else "compute"
        events += [(a, 1, kind), (b, -1, kind)]
    events.sort()
    running = {"nccl": 0, "compute": 0}
    out, last = [], events[0][0] if events else 0.0
    for t, delta, kind in events:
        if t > last:
            out.append((last, t, _state(running["nccl"], running["compute"])))
        last = t
        running[kind] += delta
    return out


def totals(rows: list[Row], steps: int = 2) -> dict[str, float]:
    """ms per step in each state (compute x2+: a compute kernel with another beside it)."""
    acc = collections.Counter()
    for a, b, state in segments(rows):
        acc[state] += b - a
    return {k: v / 1e3 / steps for k, v in acc.items()}


def summary(rows: list[Row], steps: int = 2) -> dict[str, float]:
    """ms per step: GPU busy (any kernel), NCCL, compute (non-NCCL kernels), NCCL beside compute."""
    t = totals(rows, steps)
    beside = t.get("nccl beside compute", 0.0)
    return {"busy": sum(v for k, v in t.items() if k != "idle"),
            "nccl": t.get("nccl alone", 0.0) + beside,
            "compute": t.get("compute alone", 0.0) + t.get("compute x2+", 0.0) + beside,
            "beside": beside}


def binned(rows: list[Row], width_ms: float) -> list[tuple[float, dict[str, float]]]:
    """(bin start in ms, each state's share of the bin)."""
    width = width_ms * 1e3
    bins: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for a, b, state in segments(rows):
        while a < b:
            end = min(b, (a // width + 1) * width)
            bins[int(a // width)][state] += end - a
            a = end
    return [(i * width_ms, {k: v / width for k, v in bins[i].items()}) for i in sorted(bins)]


STATES = ("idle", "nccl alone", "compute alone", "nccl beside compute", "compute x2+")


def read(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="kernel_table.py --read")
    ap.add_argument("file")
    ap.add_argument("--bin", type=float, default=5.0, help="bin width, ms")
    ap.add_argument("--bins", type=int, default=80, help="how many bins to print")
    ap.add_argument("--steps", type=int, default=2, help="steps the file holds")
    ap.add_argument("--window", type=float, nargs=2, metavar=("START", "LEN"), help="list kernels there (ms)")
    args = ap.parse_args(argv)
    rows = load(args.file)
    if args.window:
        lo, hi = args.window[0] * 1e3, (args.window[0] + args.window[1]) * 1e3
        for a, b, s, name in rows:
            if b > lo and a < hi:
                print(f"{a / 1e3:9.3f} {b - a:7.1f} us  stream {s:<5d} {name[:70]}")
        return
    print("ms per step: " + ", ".join(f"{k} {totals(rows, args.steps).get(k, 0.0):.1f}" for k in STATES))
    for start, share in binned(rows, args.bin)[: args.bins]:
        print(f"{start:8.1f} ms " + "  ".join(f"{k} {share.get(k, 0.0):4.0%}" for k in STATES))


def profiled(argv: list[str]) -> None:
    import torch
    from bench_setup import setup
    from torch.profiler import ProfilerActivity, profile

    bench = setup(argv)
    rank = bench.rank
    for _ in range(3):
        bench.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        bench.step()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            bench.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 2
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
    # the kernels with their streams, from the profiler's own trace (FunctionEvent has no stream)
    trace = f"/tmp/kernel_table_trace_{rank}.json"
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    rows = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream", -1), e["name"]) for e in events
            if e.get("ph") == "X" and e.get("cat") == "kernel"]
    busy = summary(rows)
    print(f"SUMMARY rank {rank} {' '.join(bench.overrides)}: wall {plain * 1e3:.0f} ms/step ({wall * 1e3:.0f} "
          f"profiled), GPU busy {busy['busy']:.0f} ms/step (kernels on any stream), of which NCCL {busy['nccl']:.0f} "
          f"ms, compute (non-NCCL kernels) {busy['compute']:.0f} ms, NCCL beside compute {busy['beside']:.0f} ms, "
          f"{len(rows) // 2} kernels/step", flush=True)
    for s in sorted({r[2] for r in rows}):
        mine = summary([r for r in rows if r[2] == s])
        print(f"STREAM rank {rank} stream {s}: {sum(r[2] == s for r in rows) // 2} kernels/step, "
              f"NCCL {mine['nccl']:.1f} ms/step, compute {mine['compute']:.1f} ms/step", flush=True)
    out = os.environ.get("OUT")
    if out and rows:
        first = min(r[0] for r in rows)
        with gzip.open(f"{out}/kernels_{os.environ.get('KT_TAG', 'run')}_rank{rank}.csv.gz", "wt") as f:
            csv.writer(f).writerows((f"{a - first:.1f}", f"{b - first:.1f}", s, n[:120]) for a, b, s, n in rows)
    bench.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--read"]:
        read(sys.argv[2:])
    else:
        profiled(sys.argv[1:])
