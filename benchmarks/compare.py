"""tessera against its peers on one model and layouts, in ONE run on the GPU machine.

Usage (repository root of the GPU machine, with .whl/ and .peers/ carried as benchmarks/README.md
says):

    python3 benchmarks/compare.py gpt-1.3b 1gpu dp2 tp2 pp2      # runs everything, prints the table
    python3 benchmarks/compare.py llama-1b 1gpu tp2 --dry-run     # only print the commands
    python3 benchmarks/compare.py gpt-1.3b 1gpu dp2 1gpu+train.grad_dtype=bf16 dp2+train.grad_dtype=bf16 \
        --skip mcore@1gpu,torch@1gpu    # variants: tessera alone, with more overrides; fewer peers

For each layout it runs tessera (benchmarks/quick_train.py on benchmarks/models/MODEL.toml),
megatron-core (.peers/mcore_gpt_bench.py) and, on 1 GPU and at dp=2, the compiled PyTorch model
(.peers/torch_gpt_bench.py; torch DDP at dp=2), all on the same shape (PEER_FLAGS), then prints
a markdown table of tokens/s per GPU with tessera's ratio to each peer and to tessera's own
1-GPU figure, ready for BENCHMARKS.md.

A layout written ``LAYOUT+key=value[+key=value...]`` is a variant: tessera alone, with these
overrides after the layout's own; its ratio to one GPU is against the one-GPU variant with the
same overrides when that runs too (``1gpu+train.grad_dtype=bf16`` for
``dp2+train.grad_dtype=bf16``), else against the plain one-GPU baseline. ``--skip
SYSTEM@LAYOUT[,...]`` (SYSTEM: mcore or torch) leaves a peer's run out where the call has no
time for it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parent / "models"

LAYOUTS = {  # layout -> (processes, tessera overrides, megatron-core flags)
    "1gpu": (1, [], []),
    "dp2": (2, ["parallel.zero=1"], []),
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], ["--tp", "2"]),
    "pp2": (2, ["parallel.pp=2"], ["--pp", "2"]),
    "pp2v": (2, ["parallel.pp=2", "parallel.vpp=2"], ["--pp", "2"]),  # tessera's recommended pp=2 (interleaved-zb)
}
# each benchmark model (benchmarks/models/*.toml) as both peers' flags: the same shape and batch
PEER_FLAGS = {
    "gpt-1.3b": ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "2048", "--vocab", "50304",
                 "--mbs", "2", "--gbs", "16"],
    "llama-1b": ["--llama", "1", "--layers", "16", "--hidden", "2048", "--heads", "32", "--kv-heads", "8",
                 "--ffn", "8192", "--seq", "2048", "--vocab", "128256", "--mbs", "2", "--gbs", "16"],
}


SKIP_NAMES = {"mcore": "megatron-core", "torch": "PyTorch compiled"}


def check_model(model: str) -> None:
    """A benchmark model both tessera (a TOML in benchmarks/models/) and the peers (PEER_FLAGS) run."""
    if model not in PEER_FLAGS or not (MODELS / f"{model}.toml").is_file():
        raise SystemExit(f"unknown model {model!r}: choose from {', '.join(sorted(PEER_FLAGS))}")


def split_variant(layout: str) -> tuple[str, list[str]]:
    """``dp2+train.grad_dtype=bf16`` -> ("dp2", ["train.grad_dtype=bf16"]); checks both parts."""
    base, *extra = layout.split("+")
    if base not in LAYOUTS:
        raise SystemExit(f"unknown layout {base!r} in {layout!r}: choose from {', '.join(LAYOUTS)}")
    bad = [e for e in extra if "=" not in e]
    if bad:
        raise SystemExit(f"a variant's overrides are key=value, not {bad} (in {layout!r})")
    return base, extra


def commands(model: str, layout: str, skip: frozenset[str] = frozenset()) -> list[tuple[str, list[str], dict]]:
    """(system, command, env) of each run at ``layout``; ``skip`` holds "mcore@1gpu"-style names."""
    check_model(model)
    base, extra = split_variant(layout)
    nproc, sets, mcore = LAYOUTS[base]
    env = {"NPROC": str(nproc)}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    out = [("tessera", [sys.executable, "benchmarks/quick_train.py", model, *sets, *extra], env)]
    if extra:  # a variant: tessera alone
        return out
    site = {"PYTHONPATH": "/tmp/site:" + os.environ.get("PYTHONPATH", "")}
    if f"mcore@{base}" not in skip:
        out.append(("megatron-core", launch + [".peers/mcore_gpt_bench.py", *mcore, *PEER_FLAGS[model]], site))
    if base in ("1gpu", "dp2") and f"torch@{base}" not in skip:
        torch_cmd = [".peers/torch_gpt_bench.py", *PEER_FLAGS[model]]
        out.append(("PyTorch compiled" + (" + DDP" if nproc > 1 else ""),
                    (launch if nproc > 1 else [sys.executable]) + torch_cmd, {}))
    return out


def parse_skip(text: str) -> frozenset[str]:
    names = frozenset(t.strip() for t in text.split(",") if t.strip())
    for name in names:
        system, _, layout = name.partition("@")
        if system not in SKIP_NAMES or layout not in LAYOUTS:
            raise SystemExit(f"--skip takes SYSTEM@LAYOUT with SYSTEM in {sorted(SKIP_NAMES)} and a layout of "
                             f"{', '.join(LAYOUTS)}; got {name!r}")
    return names


def tokens_per_gpu(output: str) -> float | None:
    for line in output.splitlines():
        if line.startswith("RESULT {"):
            return float(json.loads(line[len("RESULT "):])["tokens_per_s_per_gpu"])
        match = re.match(r"RESULT .*: ([\d,]+) tokens/s per GPU", line)
        if match:
            return float(match.group(1).replace(",", ""))
    return None


AGAIN = "1gpu (again, 2nd GPU)"  # tessera's one-GPU baseline run a second time, last, on the second GPU


def plan(model: str, layouts: list[str], skip: frozenset[str] = frozenset()) -> list[tuple[str, str, list[str], dict]]:
    """(layout, system, command, env) of every run, in order. With 1gpu and another (two-GPU)
    layout, tessera's one-GPU run comes again at the end, on the second GPU: its figure varied by
    up to 15 % between runs on one machine (2026-11-27, 2x H200), the GPUs train power-capped and
    one card can hold a lower clock than the other at the cap (1740 against 1800 MHz the same
    day), and a two-GPU layout runs at its slower card's pace; the ratios stand on the mean of
    both cards' runs (BENCHMARKS.md, One GPU)."""
    runs = [(layout, system, cmd, env) for layout in layouts for system, cmd, env in commands(model, layout, skip)]
    if "1gpu" in layouts and len(set(layouts)) > 1:
        system, cmd, env = commands(model, "1gpu")[0]
        runs.append((AGAIN, system, cmd, {**env, "CUDA_VISIBLE_DEVICES": second_gpu()}))
    return runs


def second_gpu() -> str:
    """The second GPU the two-GPU runs use: the second of CUDA_VISIBLE_DEVICES when it is set."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[1] if len(visible) > 1 else "1"


def baseline(rows: list[tuple[str, str, float | None]]) -> tuple[float | None, str]:
    """tessera's one-GPU figure for the ratios (the mean of its runs) and a line on its spread."""
    runs = [t for lay, s, t in rows if lay in ("1gpu", AGAIN) and s == "tessera" and t]
    if not runs:
        return None, ""
    mean = sum(runs) / len(runs)
    if len(runs) == 1:
        return mean, f"tessera one-GPU baseline: {runs[0]:,.0f} (one run)"
    spread = (max(runs) - min(runs)) / mean
    flag = " -- over 2 %: read STEPS for a slow stretch (or one card is slower)" if spread > 0.02 else ""
    return mean, (f"tessera one-GPU baseline: {', '.join(f'{t:,.0f}' for t in runs)} "
                  f"(first run on the first GPU, last on the second), mean {mean:,.0f}, spread {spread:.1%}{flag}")


def run_one(system: str, layout: str, cmd: list[str], env: dict, left: float,
            lines: list[str] | None = None) -> float | None:
    """One run's tokens/s per GPU (None if it failed or ran out of time); tessera's per-step line
    is passed on, so a slow stretch shows. ``lines``: gets the run's output lines."""
    # its own process group, so a run cut short takes its torchrun workers with it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=min(600, left - 20))
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own: SIGTERM lets it stop them
        # (a SIGKILL to the group would leave them holding the GPUs and our pipes)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:  # orphaned workers still hold the pipes
                out, err = "", ""
        print(f"{system} {layout}: no result in time", file=sys.stderr)
    if lines is not None:
        lines.extend(out.splitlines())
    for line in out.splitlines():
        if line.startswith("STEPS"):
            print(f"{layout} {system} {line}", flush=True)
    tps = tokens_per_gpu(out)
    if tps is None:
        print(f"{system} {layout} failed:\n{out[-2000:]}\n{err[-2000:]}", file=sys.stderr)
    return tps


def table(rows: list[tuple[str, str, float | None]]) -> list[str]:
    """The markdown table, ratios against the mean one-GPU baseline, and its spread line."""
    one_gpu, note = baseline(rows)
    lines = ["| layout | system | tokens/s per GPU | tessera / this | vs tessera 1 GPU |", "| --- | --- | --- | --- | --- |"]
    for layout, system, tps in rows:
        mine = next((t for lay, s, t in rows if lay == layout and s == "tessera"), None)
        ratio = f"{mine / tps:.2f}" if tps and mine and system != "tessera" else ""
        base, mark = one_gpu, ""
        if "+" in layout and layout != AGAIN:  # a variant: against the one-GPU run with the same overrides
            twin = "1gpu" + layout[layout.index("+"):]
            found = next((t for lay, s, t in rows if lay == twin and t), None) if layout != twin else None
            base, mark = (found, " (vs its 1gpu twin, one run)") if found else (one_gpu, "")
        vs_one = f"{tps / base:.3f}{mark}" if tps and base and system == "tessera" else ""
        lines.append(f"| {layout} | {system} | {tps:,.0f} | {ratio} | {vs_one} |" if tps
                     else f"| {layout} | {system} | failed | | |")
    return lines + ([note] if note else [])


def main() -> None:
    argv, skip = [a for part in sys.argv[1:] for a in (part.split("=", 1) if part.startswith("--skip=") else [part])], \
        frozenset()
    if "--skip" in argv:
        at = argv.index("--skip")
        if at + 1 >= len(argv):
            raise SystemExit("--skip needs SYSTEM@LAYOUT[,...], e.g. --skip mcore@1gpu,torch@1gpu")
        skip, argv = parse_skip(argv[at + 1]), argv[:at] + argv[at + 2:]
    args = [a for a in argv if not a.startswith("--")]
    if not args:
        raise SystemExit(f"usage: compare.py MODEL [LAYOUT ...] [--skip SYSTEM@LAYOUT,...] [--dry-run]; MODEL: "
                         f"{', '.join(sorted(PEER_FLAGS))}; LAYOUT: {', '.join(LAYOUTS)} (+key=value for a variant)")
    model, layouts, dry = args[0], args[1:] or ["1gpu"], "--dry-run" in argv
    runs = plan(model, layouts, skip)
    if dry:
        for layout, system, cmd, env in runs:
            print(" ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd))
        return
    wheels = sorted(Path(".whl").glob("*.whl"))
    if not wheels:
        raise SystemExit("no megatron-core wheel in .whl/: fetch it and carry .whl/ and .peers/ (benchmarks/README.md)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    "/tmp/site", *map(str, wheels)], check=True)
    rows = []
    # the whole run's seconds (COMPARE_BUDGET, default 3600): a run that would pass it is cut
    # short or skipped, so the table still prints inside a time-limited GPU call
    deadline = time.monotonic() + float(os.environ.get("COMPARE_BUDGET", "3600"))
    for layout, system, cmd, env in runs:
        left = deadline - time.monotonic()
        if left < 60:
            print(f"{system} {layout}: skipped, {left:.0f} s left of COMPARE_BUDGET", file=sys.stderr)
            rows.append((layout, system, None))
            continue
        tps = run_one(system, layout, cmd, env, left)
        rows.append((layout, system, tps))
        print(f"{layout} {system}: {tps}", flush=True)
    print("\n" + "\n".join(table(rows)))


if __name__ == "__main__":
    main()
