"""Where two training scripts' GPU time goes, by kind of kernel, side by side: tessera's step
against a peer's, each profiled unchanged (kernel_split_hook/ starts the profiler from a global
optimizer-step hook, so any script that steps a torch optimizer can be read).

    python3 benchmarks/kernel_split.py [--after N] -- python3 benchmarks/quick_train.py llama-1b ...
    python3 benchmarks/kernel_split.py --read A.json [B.json ...]

Prints ms per step of each kind (GEMMs, attention forward and backward, inductor's kernels, the
optimizer, the gradient norm, copies, the loss's eager kernels, the rest, NCCL), each kind's
longest kernels, and the GPU's idle time with its longest stretches and the kernels around them
("wall": the GPU's time from the window's start, a marker kernel, to the last kernel's end). The
profiled steps are step N+1 and N+2 (N >= 1, default 1: after the compiling first step); keep
them out of a timed window (quick_train's first three steps are untimed; give the peer one more
warm-up step). A step is an ``optimizer.step()`` call of the first optimizer that steps (an
offloaded update calls it once per span: count those); under torchrun rank 0 is profiled.
benchmarks/sweep.py --split runs it for tessera and the peer on each shape.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = Path(__file__).resolve().parent / "kernel_split_hook"
KINDS = ("GEMM", "attention forward", "attention backward", "inductor (triton)", "optimizer", "gradient norm",
         "copies", "loss (eager)", "other eager", "NCCL")
_ATTENTION = re.compile(r"flash|fmha|sdpa|cudnn|attn|attention", re.I)
_BACKWARD = re.compile(r"bprop|bwd|backward|dot_do_o|_dq|dkdv|cutlassB", re.I)
_GEMM = re.compile(r"nvjet|gemm|xmma|cutlass|wgmma|s16816|sm90_|sm80_|ampere_", re.I)


def kind(name: str) -> str:
    """The kind of a CUDA kernel (or copy), from its name."""
    if "nccl" in name.lower():
        return "NCCL"
    if name.startswith("triton"):  # (first: inductor names its kernels after the ops they fuse)
        return "inductor (triton)"
    if _ATTENTION.search(name):
        return "attention backward" if _BACKWARD.search(name) else "attention forward"
    if _GEMM.search(name):
        return "GEMM"
    if "LpNorm" in name:
        return "gradient norm"
    if re.search(r"adam|multi_tensor", name, re.I):
        return "optimizer"
    if re.search(r"copy|memcpy|memset|cat_|CatArray", name, re.I):
        return "copies"
    if re.search(r"cross_entropy|softmax|nll_loss", name, re.I):
        return "loss (eager)"
    return "other eager"


def split(profile: dict) -> tuple[dict[str, float], dict[str, list[tuple[float, str]]], float]:
    """From a hook's JSON: ms per step of each kind, each kind's kernels (ms per step, name),
    longest first, and the wall ms per step of the profiled steps."""
    steps = profile["steps"]
    per_kind: dict[str, float] = collections.Counter()
    kernels: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for name, (us, _count) in profile["kernels"].items():
        k = kind(name)
        per_kind[k] += us / 1e3 / steps
        kernels[k].append((us / 1e3 / steps, name))
    for k in kernels:
        kernels[k].sort(reverse=True)
    return dict(per_kind), dict(kernels), profile["wall_us"] / 1e3 / steps


def table(named: dict[str, dict], top: int = 3) -> list[str]:
    """Markdown: ms per step of each kind per profile (the first is the reference the others are
    compared with), then each kind's ``top`` longest kernels of each profile."""
    names = list(named)
    splits = {n: split(p) for n, p in named.items()}
    head = "| kind | " + " | ".join(f"{n} ms/step" for n in names) + " |"
    if len(names) > 1:
        head += " " + " | ".join(f"{n} - {names[0]}" for n in names[1:]) + " |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    rows = [k for k in KINDS if any(splits[n][0].get(k) for n in names)]
    for label, values in [(k, [splits[n][0].get(k, 0.0) for n in names]) for k in rows] + [
            ("kernels, all", [sum(splits[n][0].values()) for n in names]),
            ("wall", [splits[n][2] for n in names])]:
        line = f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |"
        if len(names) > 1:
            line += " " + " | ".join(f"{v - values[0]:+.1f}" for v in values[1:]) + " |"
        lines.append(line)
    for k in rows:
        for n in names:
            for ms, kernel in splits[n][1].get(k, [])[:top]:
                lines.append(f"  {k:<20} {n:<10} {ms:8.2f} ms  {kernel[:110]}")
    for n, profile in named.items():  # where the GPU waited: the longest stretches without a kernel
        if "idle_us" in profile:
            steps = profile["steps"]
            lines.append(f"  idle {n}: {profile['idle_us'] / 1e3 / steps:.1f} ms per step between kernels; longest:")
            for us, before, after in profile["gaps"][:top]:
                lines.append(f"    {us / 1e3:7.2f} ms after {before[:60]} | before {after[:60]}")
    return lines


def profiled_env(prefix: str, after: int = 1) -> dict[str, str]:
    """The environment that makes a run write its profile to ``prefix.<pid>.json``."""
    path = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "KERNEL_SPLIT": prefix, "KERNEL_SPLIT_AFTER": str(after)}


def collected(prefix: str) -> dict | None:
    """The profile a run under ``profiled_env(prefix)`` wrote (its one stepping process's)."""
    files = sorted(glob.glob(glob.escape(prefix) + ".*.json"), key=os.path.getmtime)
    files = [f for f in files if not f.endswith(".trace.json")]
    if not files:
        return None
    with open(files[-1]) as f:
        return json.load(f)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--read"]:
        named = {}
        for path in argv[1:]:
            with open(path) as f:
                named[Path(path).stem.split(".")[0]] = json.load(f)
        print("\n".join(table(named)))
        return
    if "--" not in argv:
        raise SystemExit("usage: kernel_split.py [--after N] -- COMMAND ... | kernel_split.py --read A.json [B.json]")
    cut = argv.index("--")
    after = int(argv[argv.index("--after") + 1]) if "--after" in argv[:cut] else 1
    if after < 1:
        raise SystemExit(f"--after counts the steps before the profiled ones, >= 1 (the first compiles), not {after}")
    prefix = os.path.join(tempfile.mkdtemp(), "run")
    subprocess.run(argv[cut + 1:], check=True, env={**os.environ, **profiled_env(prefix, after)})
    profile = collected(prefix)
    if profile is None:
        raise SystemExit("no profile was written: the command stepped no torch optimizer on a GPU "
                         f"{after + 2} times")
    print("\n".join(table({"run": profile}, top=8)))


if __name__ == "__main__":
    main(sys.argv[1:])
