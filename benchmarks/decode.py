"""Generation speed on one GPU: decode tokens/s and time to first token, tessera against Hugging
Face transformers on the same weights, beside the physical limit.

    python3 benchmarks/decode.py [MODEL] [--new-tokens 512] [--prompt-len 128] [--batches 1,32]
                                 [--ttft-len 2048] [--skip hf] [--device cuda] [--profile DIR]

MODEL: a name in benchmarks/models/ (default llama-1b) or a config TOML; random weights (seeded),
bf16. Each batch's prompts are random ids of ``--prompt-len`` tokens (no padding), greedy.

Rows (each timed after one untimed run of the same call: compilation, graph capture, allocator):

- **tessera eager**: ``generate()`` with the KV cache, one eager forward per decode step;
- **tessera graphed**: the same with ``cuda_graph=True`` (a decode step is one CUDA graph replay);
- **tessera compiled+graphed**: the same with ``compile=True`` too (the decode step compiled by
  inductor, then captured; its untimed runs compile);
- **transformers static+compile**: ``generate(cache_implementation="static")`` with its forward
  compiled (``CompileConfig(fullgraph=True, mode="reduce-overhead")``: inductor and CUDA graphs);
- **physical limit**: the HBM bytes a decode step must read (every weight but the embedding
  table, whose b looked-up rows count, and the K/V cache of the mean context) over the bandwidth
  a device-to-device copy reaches in this run.

Decode tokens/s = batch x (new tokens - 2) / (time of ``new`` tokens - time of 2 tokens): the
prefill, the first token and the first decode step (where tessera captures its graph) are left
out. Time to first token: a ``--ttft-len`` prompt (batch 1)
to its first token on the host. Every figure is from this run's GPU only.

The compiled row compiles each batch's step for its shapes, static, as one ``tessera generate``
batch does (``torch._dynamo.reset()`` before each batch: a second shape in one process would
compile once more with symbolic sizes).

``--profile DIR``: the fastest tessera row at batch 1 under torch.profiler, written to
DIR/decode_profile.txt: each kernel's count per decode step, the difference between a run of 22
new tokens and one of 2 new tokens after a prompt 20 tokens longer (the same cache capacity; the
difference leaves out the prefill, the first token and the capture) over the 20 steps between
them, and its time per step, that count times the kernel's mean time in the longer run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from quick_train import model_config  # noqa: E402

from tessera.config import load_config  # noqa: E402
from tessera.inference.generate import generate  # noqa: E402
from tessera.inference.sampling import Sampling  # noqa: E402
from tessera.models import GPTModel, TPContext  # noqa: E402
from tessera.topology import Topology  # noqa: E402

REPEATS = 2  # timed runs per figure (the median), after one untimed run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device) -> float:
    """The median wall time of ``call()`` over REPEATS runs, after one untimed run."""
    call()
    times = []
    for _ in range(REPEATS):
        sync(device)
        began = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the practical HBM limit."""
    n = int(gib * 2**30) // 2
    a, b = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    seconds = timed(lambda: b.copy_(a), device)
    return 2 * a.numel() * a.element_size() / seconds


def step_bytes(model: GPTModel, batch: int, context: float) -> float:
    """HBM bytes one decode step reads: the weights (the embedding table only for the looked-up
    rows) and each layer's K/V cache over ``context`` tokens."""
    cfg, size = model.cfg, next(model.parameters()).element_size()
    weights = sum(p.numel() for name, p in model.named_parameters() if name != "embedding.weight")
    if cfg.tie_embeddings:  # (the output layer reads the embedding matrix whole)
        weights += model.embedding.weight.numel()
    cache = 2 * cfg.layers * cfg.num_kv_heads * cfg.head_dim * context * batch
    return (weights + batch * cfg.hidden + cache) * size


PATHS = {  # row: (its --skip name, generate()'s options)
    "tessera eager": ("eager", {}),
    "tessera graphed": ("graphs", {"cuda_graph": True}),
    "tessera compiled+graphed": ("compiled", {"cuda_graph": True, "compile": True}),
}


def tessera_rows(model: GPTModel, topo: Topology, prompts: dict, new: int, ttft_prompt, rows: list[str]) -> dict:
    out = {}
    for name in rows:
        options = PATHS[name][1]

        def run(batch, tokens, options=options):
            return generate([model], batch, tokens, topo=topo, sampling=Sampling(), **options)
        row = {}
        try:
            for b, batch in prompts.items():
                if options.get("compile"):  # each batch's step compiled for its own shapes, as one
                    torch._dynamo.reset()   # `tessera generate` batch compiles it (the first shape static)
                whole, first = timed(lambda: run(batch, new), topo.device), timed(lambda: run(batch, 2), topo.device)
                row[b] = b * (new - 2) / (whole - first)
            row["ttft"] = timed(lambda: run([ttft_prompt], 1), topo.device)
        except Exception as e:  # noqa: BLE001 -- reported, the other rows still print
            print(f"{name}: not measured ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        out[name] = row
        print(f"{name}: {row}", flush=True)
    return out


def kernel_table(model: GPTModel, topo: Topology, prompt: list[int], name: str, steps: int = 20) -> str:
    """Each kernel's count and time per decode step of row ``name`` at batch 1 (CPU ops and their
    self time on a CPU). Counts: a run of ``steps + 2`` new tokens less a run of 2 new tokens after
    a prompt ``steps`` tokens longer (the same cache capacity, so the same compiled step), over
    ``steps``: the decode steps and their sampling, without the prefill, the first token and the
    capture. Time: that count times the kernel's mean time in the longer run (where a kernel the
    prefill shares runs once in the prefill against once in each of the 21 decode steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = topo.device.type == "cuda"
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    options = PATHS[name][1]
    if options.get("compile"):
        torch._dynamo.reset()  # (compiled static for this shape, as in the row)

    def durations(ids: list[int], tokens: int) -> tuple[dict, list[int]]:
        generate([model], [ids], tokens, topo=topo, sampling=Sampling(), **options)  # (compiles, captures)
        sync(topo.device)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            drawn = generate([model], [ids], tokens, topo=topo, sampling=Sampling(), **options)[0]
            sync(topo.device)
        times = {}
        for event in prof.events():
            if event.device_type == kind:
                times.setdefault(event.name, []).append(event.time_range.elapsed_us() if cuda
                                                        else event.self_cpu_time_total)
        return times, drawn

    long, drawn = durations(prompt, steps + 2)
    short, _ = durations(drawn[: len(prompt) + steps], 2)
    rows = []
    for kernel, times in long.items():
        count = (len(times) - len(short.get(kernel, []))) / steps
        if count >= 0.5:  # (a kernel of one prefill but not the other's leaves 1 / steps)
            rows.append((kernel, count, count * statistics.fmean(times)))
    rows.sort(key=lambda r: -r[2])
    total_us, total_count = sum(r[2] for r in rows), sum(r[1] for r in rows)
    what = "kernels" if cuda else "CPU ops (self time)"
    lines = [(f"{name}, batch 1, prompt of {len(prompt)} tokens (a cache of {len(prompt) + steps + 1} slots), per "
              f"decode step (counts: {steps + 2} new tokens less 2 after {steps} more prompt tokens, over {steps}; "
              f"time: count x mean), {what}"),
             (f"{total_count:.1f} {'kernels' if cuda else 'ops'} per step, {total_us:.1f} us of "
              f"{'kernel' if cuda else 'CPU'} time per step"), "",
             f"{'us/step':>9} {'%':>6} {'count/step':>10}  name"]
    lines += [f"{us:9.2f} {100 * us / max(total_us, 1e-9):6.2f} {count:10.2f}  {kernel[:160]}"
              for kernel, count, us in rows]
    return "\n".join(lines) + "\n"


def transformers_row(model: GPTModel, prompts: dict, new: int, ttft_prompt) -> dict:
    """transformers' LlamaForCausalLM / GPT2LMHeadModel holding the same weights, static cache, compiled."""
    import transformers

    from tessera.checkpoint import hf

    cfg, device = model.cfg, next(model.parameters()).device
    whole = {name: (t[: cfg.vocab_size] if name in ("embedding.weight", "output.weight") else t)
             for name, t in model.state_dict().items()}
    config = hf.hf_config(cfg) | {"dtype": "bfloat16", "use_cache": True}
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    missing, unexpected = theirs.load_state_dict(hf.to_hf(whole, cfg), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # (tied: the embedding)
        raise ValueError(f"the weights did not map: missing {missing[:3]}, unexpected {unexpected[:3]}")
    theirs = theirs.to(device=device, dtype=next(model.parameters()).dtype).eval()
    kwargs = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    if hasattr(transformers, "CompileConfig") and device.type == "cuda":
        kwargs["compile_config"] = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")

    def run(batch, tokens):
        ids = torch.tensor(batch, device=device)
        with torch.no_grad():
            return theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                   min_new_tokens=tokens, **kwargs)
    row = {}
    for b, batch in prompts.items():
        whole_t, first = timed(lambda: run(batch, new), device), timed(lambda: run(batch, 2), device)
        row[b] = b * (new - 2) / (whole_t - first)
    row["ttft"] = timed(lambda: run([ttft_prompt], 1), device)
    # the same weights: greedy tokens agree (16-bit rounding may part them after a while)
    prompt = next(iter(prompts.values()))[0]
    ours = generate([model], [prompt], 32, topo=Topology.build(device=device))[0][len(prompt):]
    same = next((i for i, (a, b) in enumerate(zip(ours, run([prompt], 32)[0, len(prompt):].tolist())) if a != b), 32)
    print(f"transformers: the first {same} of 32 greedy tokens equal tessera's", flush=True)
    return {"transformers static+compile": row}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="llama-1b")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--ttft-len", type=int, default=2048, help="the time-to-first-token prompt's length")
    parser.add_argument("--skip", default="", help="comma-separated: hf, eager, graphs, compiled")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="model overrides (smoke runs)")
    parser.add_argument("--profile", metavar="DIR", help="write the fastest tessera row's kernels per decode step at "
                        "batch 1 to DIR/decode_profile.txt")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device(args.device)
    cfg = load_config(model_config(args.model), args.overrides).model
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = GPTModel(cfg, TPContext(fused_elementwise=cfg.family == "llama" and device.type == "cuda"), device=device)
    model.init_weights(1234)
    model.to(dtype).eval()
    topo = Topology.build(device=device)
    gen = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, args.prompt_len), generator=gen).tolist() for b in batches}
    ttft_prompt = torch.randint(0, cfg.vocab_size, (min(args.ttft_len, cfg.seq_len),), generator=gen).tolist()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"decode: {args.model} ({cfg.family}, {sum(p.numel() for p in model.parameters()):,} parameters, {dtype}) "
          f"on {name}, torch {torch.__version__}; prompts of {args.prompt_len} tokens, {args.new_tokens} new, greedy",
          flush=True)
    paths = [row for row, (short, options) in PATHS.items() if short not in skip
             and (device.type == "cuda" or not options.get("cuda_graph"))]
    rows = tessera_rows(model, topo, prompts, args.new_tokens, ttft_prompt, paths)
    if args.profile and rows:
        smallest = 1 if 1 in prompts else batches[0]  # (the rows measured at batch 1 where asked)
        fastest = max(rows, key=lambda name: rows[name][smallest])
        prompt = prompts[smallest][0]
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        table = kernel_table(model, topo, prompt, fastest)
        if smallest == 1:
            table = f"measured above: {1e3 / rows[fastest][1]:.3f} ms per token at batch 1\n" + table
        (Path(args.profile) / "decode_profile.txt").write_text(table)
        print(f"profile of {fastest} at batch 1: {args.profile}/decode_profile.txt\n"
              + "\n".join(table.splitlines()[:24]), flush=True)
    if "hf" not in skip:
        try:
            rows |= transformers_row(model, prompts, args.new_tokens, ttft_prompt)
        except Exception as e:  # noqa: BLE001 -- reported, the other rows still print
            print(f"transformers: not measured ({type(e).__name__}: {str(e)[:300]})", flush=True)
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        context = args.prompt_len + args.new_tokens / 2
        rows["physical limit"] = {b: b * bandwidth / step_bytes(model, b, context) for b in batches}
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; a decode step reads "
              + ", ".join(f"{step_bytes(model, b, context) / 1e9:.2f} GB at batch {b}" for b in batches)
              + f" (mean context {context:.0f} tokens)")
    header = ["", *[f"batch {b} tok/s" for b in batches], f"TTFT {len(ttft_prompt)} (ms)"]
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for label, row in rows.items():
        cells = [f"{row[b]:,.0f}" for b in batches] + [f"{row['ttft'] * 1e3:.1f}" if "ttft" in row else "-"]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
