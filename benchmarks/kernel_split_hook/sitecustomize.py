"""Profiles two optimizer steps of any PyTorch training script, tessera's or a peer's, unchanged.

benchmarks/kernel_split.py puts this folder first on PYTHONPATH with KERNEL_SPLIT set to an output
prefix; Python then imports this module at start in every process. Where the variable is set, a
global optimizer-step hook starts torch.profiler after step KERNEL_SPLIT_AFTER (default 1) of the
first optimizer that steps, stops it KERNEL_SPLIT_STEPS (default 2) steps later, and writes each
CUDA kernel's (and copy's) total time and count to ``$KERNEL_SPLIT.<pid>.json`` (rank 0 alone
under torchrun), with the time between kernels and its longest stretches (what ran either side).
The start does not wait for the GPU (a host that waited would fall behind it, and the next step
would start with an idle stretch no unprofiled step has): a marker kernel queued behind the
optimizer step starts the window, and only what ran after it counts.
A ``sitecustomize`` later on the path (the system's) still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

_mine = os.path.realpath(__file__)
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(_mine)])
if _next is not None and _next.loader is not None and os.path.realpath(_next.origin or "") != _mine:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))


def gaps(spans: list[tuple[float, float, str]], top: int = 12) -> tuple[float, list[tuple[float, str, str]]]:
    """The time no kernel ran between the first and the last of ``spans`` (start, end, name; µs,
    any streams), and its ``top`` longest stretches: (µs, the kernel before, the kernel after)."""
    spans = sorted(spans)
    found, end, last = [], spans[0][1] if spans else 0.0, spans[0][2] if spans else ""
    for a, b, name in spans[1:]:
        if a > end:
            found.append((a - end, last[:100], name[:100]))
        if b > end:
            end, last = b, name
    return sum(g for g, _, _ in found), sorted(found, reverse=True)[:top]


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: queued where the profiled steps start


def after_marker(spans: list[tuple[float, float, str]]) -> tuple[list[tuple[float, float, str]], float, float]:
    """The spans from the end of the (first) marker kernel on, clipped there (a kernel of another
    stream may straddle it), the window's start and its length to the last span's end (µs); all
    of them and their extent where there is no marker."""
    ends = [b for _, b, name in spans if MARKER in name]
    start = min(ends) if ends else min((a for a, _, _ in spans), default=0.0)
    kept = [(max(a, start), b, name) for a, b, name in spans if b > start and MARKER not in name]
    return kept, start, max((b for _, b, _ in kept), default=start) - start


if os.environ.get("KERNEL_SPLIT") and os.environ.get("RANK", "0") == "0":
    import json

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    _after = max(1, int(os.environ.get("KERNEL_SPLIT_AFTER", "1")))
    _steps = int(os.environ.get("KERNEL_SPLIT_STEPS", "2"))
    _state = {"optimizer": None, "count": 0, "profiler": None}

    def _write(prof: profile) -> None:
        trace = f"{os.environ['KERNEL_SPLIT']}.{os.getpid()}.trace.json"
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        os.remove(trace)
        spans, start, wall = after_marker([(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
                                           for e in events if e.get("ph") == "X"
                                           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")])
        kernels: dict[str, list[float]] = {}
        for a, b, name in spans:
            acc = kernels.setdefault(name, [0.0, 0])
            acc[0] += b - a
            acc[1] += 1
        idle, longest = gaps([(start, start, MARKER)] + spans)  # (a wait right after the marker is idle too)
        with open(f"{os.environ['KERNEL_SPLIT']}.{os.getpid()}.json", "w") as f:
            json.dump({"steps": _steps, "wall_us": wall, "kernels": kernels, "idle_us": idle, "gaps": longest}, f)

    def _hook(optimizer, args, kwargs) -> None:
        if _state["optimizer"] is None:
            _state["optimizer"] = optimizer
        if optimizer is not _state["optimizer"] or not torch.cuda.is_available():
            return
        _state["count"] += 1
        if _state["count"] == _after:
            _state["profiler"] = profile(activities=[ProfilerActivity.CUDA])
            _state["profiler"].start()
            if hasattr(torch.cuda, "_sleep"):  # (a private API: without it the window is all the profile)
                torch.cuda._sleep(1)  # the marker, behind this step's optimizer kernels
        elif _state["count"] == _after + _steps:
            torch.cuda.synchronize()
            _state["profiler"].stop()
            _write(_state["profiler"])

    register_optimizer_step_post_hook(_hook)
