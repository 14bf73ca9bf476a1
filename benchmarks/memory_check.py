"""The memory model and the planner's step time checked against the card, on one GPU, in one process.

    python benchmarks/memory_check.py                 # 10 configurations: GPT-1.3B and Llama-1B shapes
    python benchmarks/memory_check.py --llama8b       # a Llama-3-8B shape with recompute full + offload
    python benchmarks/memory_check.py --cpu-smoke     # the same code on tiny shapes on a CPU

Each configuration is built as ``tessera train`` builds it (bench_setup), trained for a few steps,
and compared: the predicted peak (training/memory_model.py, the largest pipeline rank) against
``torch.cuda.max_memory_allocated`` since before the build, and the planner's step time
(training/planner.py's model at its default H200 numbers) against the median measured step after
one warm-up step. One JSON line per configuration, then a markdown table. A configuration that
runs out of memory is reported as OOM and the next one runs. Layers run eagerly
(``train.compile=false``): the model leaves compiled code's workspaces out.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench_setup, quick_train)
import bench_setup  # noqa: E402

from quick_train import model_config  # noqa: E402

from tessera.config import load_config  # noqa: E402
from tessera.training.memory_model import model_state, predict_ranks  # noqa: E402
from tessera.training.preflight import validate  # noqa: E402
from tessera.training.planner import Machine, step_time  # noqa: E402

GIB = 2**30
EAGER = ["train.compile=false", "train.cuda_graphs=false"]
# (model, recompute, micro-batch, offload); two micro-batches per step
CONFIGS = [("gpt-1.3b", "none", 1, False), ("gpt-1.3b", "selective", 2, False), ("gpt-1.3b", "full", 8, False),
           ("gpt-1.3b", "none", 2, True), ("gpt-1.3b", "full", 4, True),
           ("llama-1b", "none", 1, False), ("llama-1b", "selective", 4, False), ("llama-1b", "full", 8, False),
           ("llama-1b", "selective", 2, True), ("llama-1b", "full", 8, True)]
# a Llama-3-8B shape (https://huggingface.co/meta-llama/Meta-Llama-3-8B config.json)
LLAMA_8B = ["model.family=llama", "model.layers=32", "model.hidden=4096", "model.heads=32", "model.kv_heads=8",
            "model.ffn_hidden=14336", "model.vocab_size=128256", "model.tie_embeddings=false",
            "model.rope_theta=500000", "train.dtype=bf16", "data.source=synthetic"]
# host memory the process takes besides the offloaded optimizer (CUDA context, libraries, the model's
# build): 12.5 GiB measured with a 29-layer Llama-3-8B shape on one H200 (BENCHMARKS.md), rounded up
OTHER_HOST = 16 * GIB
TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=64", "model.vocab_size=256",
        "train.device=cpu"]
TINY_LLAMA = ["model.kv_heads=2", "model.ffn_hidden=128"]


def host_peak() -> int:
    """This process's largest resident set so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_available() -> int:
    """Host memory available now (/proc/meminfo's MemAvailable), bytes; 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_need(sets: list[str]) -> int:
    """The offloaded optimizer's predicted host bytes for ``sets`` on one process."""
    cfg = validate(load_config(model_config("gpt-1.3b"), sets), 1)
    return model_state(cfg).host


def layers_that_fit(sets: list[str], layers: int, budget: int) -> int:
    """The most layers (at most ``layers``) whose offloaded state fits ``budget`` host bytes."""
    while layers > 1 and host_need([*sets, f"model.layers={layers}"]) > budget:
        layers -= 1
    return layers


def run(name: str, model: str, sets: list[str], steps: int, on_cuda: bool) -> dict:
    """Build ``model`` with ``sets``, train ``steps`` steps; predicted against measured."""
    out = {"config": name}
    bench = None
    try:
        if on_cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if on_cuda else 0
        bench = bench_setup.setup([model, *sets])
        cfg, plan = bench.cfg, bench.parts.plan
        peak = max(predict_ranks(cfg, plan, "cuda" if on_cuda else "cpu"), key=lambda p: p.total)
        out.update(predicted_gib=peak.total / GIB, predicted_host_gib=peak.state.host / GIB,
                   predicted_step_s=step_time(cfg, plan, Machine(gpus=1, memory=141 * GIB))["step"])
        tokens = cfg.train.global_batch * cfg.model.seq_len
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            _, result = bench.step()
            loss = float(result.loss)  # (waits for the step)
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        measured = (torch.cuda.max_memory_allocated() - base) if on_cuda else None
        step = statistics.median(times[1:] or times)
        out.update(loss=loss, measured_step_s=step, tokens_per_s=tokens / step, host_peak_gib=host_peak() / GIB)
        if measured is not None:
            out.update(measured_gib=measured / GIB, ratio=peak.total / measured)
        out["step_ratio"] = out["predicted_step_s"] / step
    except torch.OutOfMemoryError as e:
        out.update(oom=True, error=str(e).splitlines()[0][:200])
    except Exception as e:  # (reported, and the next configuration runs)
        out.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    finally:
        if bench is not None:
            bench.close()
        del bench
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
    return out


def table(rows: list[dict]) -> str:
    def f(row, key, fmt):
        if row.get("oom") or (row.get("error") and row.get(key) is None):
            return "OOM" if row.get("oom") else "error"
        return format(row[key], fmt) if row.get(key) is not None else "-"

    lines = ["| config | predicted GiB | measured GiB | ratio | host GiB (pred.) | predicted step s | measured step s "
             "| ratio | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {f(r, 'predicted_gib', '.3g')} | {f(r, 'measured_gib', '.3g')} | "
                     f"{f(r, 'ratio', '.3f')} | {f(r, 'predicted_host_gib', '.3g')} | {f(r, 'predicted_step_s', '.3g')} | "
                     f"{f(r, 'measured_step_s', '.3g')} | {f(r, 'step_ratio', '.2f')} | {f(r, 'tokens_per_s', ',.0f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on a CPU: the script's own check")
    parser.add_argument("--llama8b", action="store_true", help="the Llama-3-8B shape, recompute full, offload on")
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration, the first a warm-up (4)")
    parser.add_argument("--seq-len", type=int, default=4096, help="--llama8b's sequence length (4096)")
    parser.add_argument("--layers", type=int, default=32, help="--llama8b's layers (32); fewer where the "
                        "offloaded state (12 bytes per parameter and two gradient staging buffers: ~94 GiB at 32 "
                        "layers) and 16 GiB for the rest of the process would not fit the available host memory")
    parser.add_argument("--no-offload-too", action="store_true",
                        help="--llama8b: also try the same run without offload (it may not fit)")
    args = parser.parse_args(argv)
    on_cuda = not args.cpu_smoke
    if on_cuda and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or give --cpu-smoke for the tiny shapes on a CPU")
    shrink = TINY if args.cpu_smoke else []
    rows = []
    if args.llama8b:
        seq = 64 if args.cpu_smoke else args.seq_len
        common = LLAMA_8B + [f"model.seq_len={seq}", "train.micro_batch=1", "train.global_batch=2",
                             "train.recompute=full", *EAGER, *shrink, *(TINY_LLAMA if shrink else [])]
        layers = args.layers if not args.cpu_smoke else 2
        available = host_available()
        if available and not args.cpu_smoke:
            need = host_need([*common, "parallel.optimizer_offload=true", f"model.layers={layers}"])
            fit = layers_that_fit([*common, "parallel.optimizer_offload=true"], layers, available - OTHER_HOST)
            print(f"# llama-8b: {layers} layers need {need / GIB:.1f} GiB of host memory for the offloaded "
                  f"optimizer and ~{OTHER_HOST / GIB:.0f} GiB besides; {available / GIB:.1f} GiB available: "
                  + (f"running {fit} layers (the most that fit)" if fit < layers else "it fits"), flush=True)
            layers = fit
        common.append(f"model.layers={layers}")
        wanted = [("llama-8b offload", True)] + ([("llama-8b no offload", False)] if args.no_offload_too else [])
        for name, offload in wanted:
            rows.append(run(f"{name} ({layers} layers, seq {seq})", "gpt-1.3b",
                            [*common, f"parallel.optimizer_offload={str(offload).lower()}"], args.steps, on_cuda))
            rows[-1]["host_available_gib_at_end"] = host_available() / GIB
            print(json.dumps(rows[-1]), flush=True)
    else:
        for model, recompute, mb, offload in CONFIGS:
            name = f"{model} recompute={recompute} mb={mb} offload={'on' if offload else 'off'}"
            sets = [f"train.recompute={recompute}", f"train.micro_batch={mb}", f"train.global_batch={2 * mb}",
                    f"parallel.optimizer_offload={str(offload).lower()}", *EAGER, *shrink,
                    *(TINY_LLAMA if shrink and model.startswith("llama") else [])]
            rows.append(run(name, model, sets, args.steps, on_cuda))
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
