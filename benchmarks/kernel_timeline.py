"""Read the kernels kernel_table.py writes under $OUT (kernels_TAG_rankR.csv.gz: start and end in
µs from the first kernel, stream, name; two profiled steps) and print where the GPU's time went:
idle, NCCL alone, compute alone, NCCL beside compute, two compute kernels at once; then the same
per time bin, to see which phase of the step overlaps (session 18 found micro-batch pairs running
one after the other this way); ``--window START LEN`` lists the kernels of a stretch (ms).
`python benchmarks/kernel_timeline.py FILE [--bin MS] [--bins N] [--window START LEN]`"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def load(path: str) -> list[tuple[float, float, int, str]]:
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


def segments(rows) -> list[tuple[float, float, str]]:
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


def totals(rows, steps: int = 2) -> dict[str, float]:
    """ms per step in each state (compute x2+ is compute with another compute kernel beside it)."""
    acc = collections.Counter()
    for a, b, state in segments(rows):
        acc[state] += b - a
    return {k: v / 1e3 / steps for k, v in acc.items()}


def summary(rows, steps: int = 2) -> dict[str, float]:
    """ms per step: GPU busy (any kernel), NCCL, compute (non-NCCL kernels), NCCL beside compute."""
    t = totals(rows, steps)
    beside = t.get("nccl beside compute", 0.0)
    return {"busy": sum(v for k, v in t.items() if k != "idle"),
            "nccl": t.get("nccl alone", 0.0) + beside,
            "compute": t.get("compute alone", 0.0) + t.get("compute x2+", 0.0) + beside,
            "beside": beside}


def binned(rows, width_ms: float) -> list[tuple[float, dict[str, float]]]:
    """(bin start in ms, each state's share of the bin)."""
    width = width_ms * 1e3
    bins: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for a, b, state in segments(rows):
        while a < b:
            end = min(b, (a // width + 1) * width)
            bins[int(a // width)][state] += end - a
            a = end
    return [(i * width_ms, {k: v / width for k, v in bins[i].items()}) for i in sorted(bins)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--bin", type=float, default=5.0, help="bin width, ms")
    ap.add_argument("--bins", type=int, default=80, help="how many bins to print")
    ap.add_argument("--steps", type=int, default=2, help="steps the file holds")
    ap.add_argument("--window", type=float, nargs=2, metavar=("START", "LEN"), help="list kernels there (ms)")
    args = ap.parse_args()
    rows = load(args.file)
    if args.window:
        lo, hi = args.window[0] * 1e3, (args.window[0] + args.window[1]) * 1e3
        for a, b, s, name in rows:
            if b > lo and a < hi:
                print(f"{a / 1e3:9.3f} {b - a:7.1f} us  stream {s:<5d} {name[:70]}")
        return
    states = ("idle", "nccl alone", "compute alone", "nccl beside compute", "compute x2+")
    print("ms per step: " + ", ".join(f"{k} {totals(rows, args.steps).get(k, 0.0):.1f}" for k in states))
    for start, share in binned(rows, args.bin)[: args.bins]:
        print(f"{start:8.1f} ms " + "  ".join(f"{k} {share.get(k, 0.0):4.0%}" for k in states))


if __name__ == "__main__":
    main()
