"""tessera against the compiled PyTorch peer over the shapes people train, on one GPU, in one call.

    python3 benchmarks/sweep.py                  # every shape, tessera then the peer for each
    python3 benchmarks/sweep.py --part 1/2       # the first half of the shapes (a call's budget)
    python3 benchmarks/sweep.py --only s8k-gqa8-v128k --dry-run
    python3 benchmarks/sweep.py --part 2/3 --try train.compile=false   # auto's choice against another
    python3 benchmarks/sweep.py --part 1/3 --split     # and where each side's GPU time goes
    python3 benchmarks/sweep.py --no-peer --try train.grad_accum_fusion=false   # tessera alone

Each shape is a Llama-style model (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head)
run by benchmarks/quick_train.py (tessera, every fast path at ``auto``) and by
.peers/torch_gpt_bench.py (plain PyTorch, torch.compile, fused AdamW, fp32 master weights and
bf16 autocast) with the same shape and batch. It prints a markdown table of tokens/s, the ratio
and tessera's MFU. ``--try KEY=VALUE[+KEY=VALUE]`` (repeatable) adds a tessera run per shape
with those overrides, its ratio to auto's run beside it: the check that auto chose the faster
path on that shape. ``--split`` profiles two warm-up steps of tessera's run and of the peer's
(benchmarks/kernel_split.py; the peer gets a fourth warm-up step, so no profiled step is timed)
and prints their GPU time per kind of kernel side by side; ``--no-peer`` leaves the peer out (for
``--try`` alone); the profiles' JSON files go to $OUT (else a temporary folder). SWEEP_BUDGET
(seconds, default 560) bounds the whole call: runs that would pass it are skipped and said so.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import run_one  # noqa: E402
from kernel_split import collected, profiled_env, table  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int
    micro_batch: int
    micro_batches: int = 8  # per step: the global batch is micro_batch x this

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tessera_overrides(self, steps: int) -> list[str]:
        return [f"model.hidden={self.hidden}", f"model.layers={self.layers}", f"model.heads={self.heads}",
                f"model.kv_heads={self.kv_heads}", f"model.ffn_hidden={self.ffn}", f"model.seq_len={self.seq}",
                f"model.vocab_size={self.vocab}", f"train.micro_batch={self.micro_batch}",
                f"train.global_batch={self.micro_batch * self.micro_batches}", f"train.steps={steps}"]

    def peer_flags(self, steps: int, warmup: int = 3) -> list[str]:
        return ["--llama", "1", "--layers", str(self.layers), "--hidden", str(self.hidden), "--heads", str(self.heads),
                "--kv-heads", str(self.kv_heads), "--ffn", str(self.ffn), "--seq", str(self.seq),
                "--vocab", str(self.vocab), "--mbs", str(self.micro_batch),
                "--gbs", str(self.micro_batch * self.micro_batches), "--iters", str(steps - 3), "--warmup", str(warmup)]


# sequence 2k-16k, head dim 64 and 128, GQA ratio 1, 4 and 8, vocabulary 32k-152k, hidden 2048-4096
# (layers that fit one GPU with fp32 main weights and Adam), micro-batch 1-4
SHAPES = [
    Shape("s2k-hd64-mha-v32k-mb4", 2048, 16, 32, 32, 8192, 2048, 32000, 4),
    Shape("llama-3b-s4k", 3072, 28, 24, 8, 8192, 4096, 128256, 1),
    Shape("s4k-hd128-gqa4-v128k-mb2", 2048, 16, 16, 4, 8192, 4096, 128256, 2),
    Shape("h4096-s2k-gqa4-v152k", 4096, 12, 32, 8, 14336, 2048, 151936, 1),
    Shape("s8k-gqa8-v128k", 2048, 16, 16, 2, 8192, 8192, 128256, 1),
    Shape("s16k-gqa8-v32k", 2048, 12, 16, 2, 8192, 16384, 32000, 1),
]
STEPS = 9  # quick_train leaves out 3 warm-up steps; the peer times the same 6 after its 3


def parameters(s: Shape) -> float:
    """Weights of the shape (embedding and head untied), for the table."""
    kv = s.kv_heads * s.head_dim
    layer = s.hidden * (s.hidden + 2 * kv) + s.hidden * s.hidden + 3 * s.hidden * s.ffn + 2 * s.hidden
    return s.layers * layer + 2 * s.vocab * s.hidden + s.hidden


def variants(argv: list[str]) -> list[list[str]]:
    """``--try a=1+b=2 --try c=3`` -> [["a=1", "b=2"], ["c=3"]]."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--try":
            if i + 1 >= len(argv) or "=" not in argv[i + 1]:
                raise SystemExit("--try takes KEY=VALUE[+KEY=VALUE...], e.g. --try train.compile=false")
            out.append(argv[i + 1].split("+"))
    return out


def pick(argv: list[str]) -> tuple[list[Shape], bool]:
    shapes, dry = SHAPES, "--dry-run" in argv
    if "--only" in argv:
        names = argv[argv.index("--only") + 1].split(",")
        unknown = [n for n in names if n not in {s.name for s in SHAPES}]
        if unknown:
            raise SystemExit(f"unknown shape {unknown}: choose from {', '.join(s.name for s in SHAPES)}")
        shapes = [s for s in SHAPES if s.name in names]
    if "--part" in argv:
        match = re.fullmatch(r"(\d+)/(\d+)", argv[argv.index("--part") + 1])
        if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
            raise SystemExit("--part takes K/N with 1 <= K <= N, e.g. --part 1/2")
        k, n = int(match.group(1)), int(match.group(2))
        shapes = shapes[(k - 1) * len(shapes) // n: k * len(shapes) // n]
    return shapes, dry


def mfu_of(line: str) -> str:
    match = re.search(r"MFU ([\d.]+%)", line)
    return match.group(1) if match else ""


def main() -> None:
    shapes, dry = pick(sys.argv[1:])
    tries = variants(sys.argv[1:])
    profiling, peer = "--split" in sys.argv, "--no-peer" not in sys.argv
    folder = os.environ.get("OUT") or tempfile.mkdtemp()
    deadline = time.monotonic() + float(os.environ.get("SWEEP_BUDGET", "560"))
    rows = []
    for s in shapes:
        runs = [("tessera", [sys.executable, "benchmarks/quick_train.py", "llama-1b", *s.tessera_overrides(STEPS)])]
        if peer:
            runs.append(("torch", [sys.executable, ".peers/torch_gpt_bench.py",
                                   *s.peer_flags(STEPS, warmup=4 if profiling else 3)]))
        runs += [("+".join(extra), [sys.executable, "benchmarks/quick_train.py", "llama-1b",
                                    *s.tessera_overrides(STEPS), *extra]) for extra in tries]
        figures = {}
        for system, cmd in runs:
            if dry:
                print(" ".join(cmd))
                continue
            left = deadline - time.monotonic()
            if left < 90:
                print(f"{s.name} {system}: skipped, {left:.0f} s left of SWEEP_BUDGET", file=sys.stderr, flush=True)
                figures[system] = (None, "")
                continue
            captured: list[str] = []
            env = {"NPROC": "1"}
            if profiling and system in ("tessera", "torch"):
                env.update(profiled_env(os.path.join(folder, f"split_{s.name}_{system}")))
            tps = run_one(system, s.name, cmd, env, left, lines=captured)
            figures[system] = (tps, next((mfu_of(line) for line in captured if line.startswith("RESULT")), ""))
            print(f"{s.name} {system}: {tps}", flush=True)
        if not dry:
            rows.append((s, figures))
        profiles = {system: collected(os.path.join(folder, f"split_{s.name}_{system}"))
                    for system in ("tessera", "torch")} if profiling and not dry else {}
        if any(profiles.values()):
            print(f"\n{s.name}: GPU time by kind of kernel, two steps profiled after the first")
            print("\n".join(table({k: v for k, v in profiles.items() if v})), flush=True)
    if dry:
        return
    for s, figures in rows if tries else ():
        auto = figures.get("tessera", (None, ""))[0]
        for extra in tries:
            name = "+".join(extra)
            theirs = figures.get(name, (None, ""))[0]
            print(f"{s.name}: {name} {f'{theirs:,.0f}' if theirs else 'failed'} tokens/s"
                  + (f", {theirs / auto:.3f} of auto's" if theirs and auto else ""))
    print("\n| shape | params | head dim | GQA | seq | vocab | micro-batch | tessera tokens/s | MFU | "
          "PyTorch compiled | tessera / PyTorch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s, figures in rows:
        (mine, mfu), (theirs, _) = figures.get("tessera", (None, "")), figures.get("torch", (None, ""))
        ratio = f"{mine / theirs:.3f}" if mine and theirs else ""
        print(f"| {s.name} | {parameters(s) / 1e9:.2f}B | {s.head_dim} | {s.heads // s.kv_heads} | {s.seq} | {s.vocab} | "
              f"{s.micro_batch} | {f'{mine:,.0f}' if mine else 'failed'} | {mfu} | "
              f"{f'{theirs:,.0f}' if theirs else 'failed' if peer else 'not run'} | {ratio} |")


if __name__ == "__main__":
    main()
