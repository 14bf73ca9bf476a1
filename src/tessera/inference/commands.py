"""``tessera generate`` and ``tessera eval``: a checkpoint's model (a run's, or one imported from
transformers) continuing prompts, or scored on data, on any layout.

    tessera generate --checkpoint ckpt --prompt "The " [--max-new-tokens 64] [--temperature 0]
    tessera generate --checkpoint ckpt --prompts prompts.jsonl --json --nproc-per-node 4 --set parallel.tp=2 --set parallel.pp=2
    tessera eval --checkpoint ckpt [--split valid | --jsonl docs.jsonl] [--set data.paths=...]

The layout is set as ``tessera train`` sets it (``--set parallel.tp=2``, ``--nproc-per-node N``
or under torchrun); ranks beyond tp x pp are data-parallel replicas sharing the prompts or the
sequences. Every refusal is one line naming the flag or key and the fix, exit status 2, before
any process group exists (with ``--nproc-per-node``, before torchrun starts).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

from tessera.config import ConfigError


def _count(zero_ok: bool):
    def parse(text: str) -> int:
        import argparse

        value = int(text)
        if value < (0 if zero_ok else 1):
            raise argparse.ArgumentTypeError(f"must be an integer >= {0 if zero_ok else 1}, got {text}")
        return value
    return parse


def _common(parser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="a step_N folder, or a folder of them (its newest); a run's or `tessera checkpoint import`'s")
    parser.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json (default: the checkpoint's own, else "
                        "its run's data's: PREFIX.tokenizer.json beside the first indexed dataset, bytes for the builtin corpus)")
    parser.add_argument("--batch-size", type=_count(False), default=32, metavar="B",
                        help="sequences per forward on each data-parallel replica (default: 32 generate, 8 eval)")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="the layout and device, as for train: parallel.tp, parallel.pp, parallel.vpp, "
                        "parallel.sequence_parallel, train.device, train.dtype; data.* for eval")
    parser.add_argument("--nproc-per-node", type=_count(True), default=0, metavar="N",
                        help="check for N processes, then launch them with torchrun")


def add_inference_commands(sub) -> None:
    gen = sub.add_parser("generate", help="continue prompts with a checkpoint's model (KV cache, any tp and pp)")
    _common(gen)
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    gen.add_argument("--prompts", metavar="FILE", help='prompts as JSON lines, {"prompt": TEXT} each')
    gen.add_argument("--max-new-tokens", type=_count(True), default=64, metavar="N",
                     help="new tokens per prompt at most; a prompt ends earlier at the end-of-document id (default 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy; else the logits / temperature (default 0.8)")
    gen.add_argument("--top-k", type=int, default=0, help="draw among the k likeliest tokens (0: all; default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="draw among the likeliest tokens holding this "
                     "probability (1: all; default)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    gen.add_argument("--no-stop", action="store_true", help="go on past the end-of-document id")
    gen.add_argument("--cuda-graph", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                     help="replay each decode step as one CUDA graph: auto (default) where measured, on CUDA at tp=1 "
                     "and pp=1 with the KV cache (15x eager decode at batch 1: BENCHMARKS.md, Inference); on: also at "
                     "tp>1; off: launch each kernel")
    gen.add_argument("--compile", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                     help="compile the decode step with inductor (fused elementwise kernels), then capture it where "
                     "the decode step is graphed; the first batch compiles (a second shape once more): auto (default) "
                     "is off: compiling takes longer than a short generation lasts; on: 1.13x the graphed step at "
                     "batch 1 and 1.15x at 32 once compiled (BENCHMARKS.md, Inference), for long or many "
                     "generations; also ungraphed and on a CPU (inductor's C++ kernels); off")
    gen.add_argument("--no-cache", action="store_true", help="the reference: run the whole context each step")
    ev = sub.add_parser("eval", help="a checkpoint's mean loss per token and perplexity on data (any tp, pp, dp)")
    _common(ev)
    ev.add_argument("--split", choices=("train", "valid", "test"), default="valid",
                    help="the part of data.split to read (default valid)")
    ev.add_argument("--samples", type=_count(True), default=0, help="samples of the split (0: one epoch; default)")
    ev.add_argument("--jsonl", metavar="FILE", help="score each line's text instead (JSON lines)")
    ev.add_argument("--key", default="text", help="the field of --jsonl lines holding the text (default text)")
    ev.set_defaults(batch_size=8)


@dataclass
class Request:
    """What every rank checks before any process group: the checkpoint, config, tokenizer, inputs."""

    path: str
    meta: dict
    cfg: object
    vocab: object
    tokenizer: object | None
    prompts: list[list[int]]  # generate: token ids
    texts: list[str]
    sequences: list | None = None  # eval --jsonl: the windows to score


def check_request(args, world_size: int) -> Request:
    """Every refusal of ``args`` for ``world_size`` processes (ConfigError), before any work."""
    from tessera.inference.loading import (checkpoint_vocabulary, check_layout, find_checkpoint,
                                           inference_config, open_tokenizer)
    from tessera.training.launch import check_device

    path, meta = find_checkpoint(args.checkpoint)
    cfg = check_layout(inference_config(meta, args.overrides), world_size)
    check_device(cfg.train.device)
    if args.command == "eval" and not args.jsonl:
        from tessera.config import parse_overrides
        from tessera.inference.perplexity import split_samples

        if meta.get("contents") == "weights" and "data" not in parse_overrides(args.overrides):
            raise ConfigError("--jsonl", f"{path} is an imported model: it has no run whose data to read",
                              "give --jsonl FILE, or the data with --set data.source=indexed --set data.paths=PREFIX")
        if args.tokenizer:
            raise ConfigError("--tokenizer", "is for --jsonl text: a split of the data is token ids already",
                              "leave --tokenizer out, or give --jsonl FILE")
        split_samples(cfg, args.split, args.samples)
        return Request(path, meta, cfg, None, None, [], [])
    vocab = checkpoint_vocabulary(path, meta, args.tokenizer)
    tokenizer = open_tokenizer(vocab, cfg.model.vocab_size)
    if args.command == "eval":
        from tessera.inference.perplexity import file_sequences

        sequences = file_sequences(args.jsonl, args.key, tokenizer, cfg.model.seq_len)
        return Request(path, meta, cfg, vocab, tokenizer, [], [], sequences)
    texts = _prompt_texts(args)
    prompts = [tokenizer.encode(text) for text in texts]
    for i, ids in enumerate(prompts):
        where = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
        if not ids:
            raise ConfigError("--prompt", f"{where} ({texts[i][:40]!r}) encodes to no tokens", "give some text to continue")
        if len(ids) > cfg.model.seq_len:
            raise ConfigError("--prompt", f"{where} is {len(ids)} tokens, longer than the model's seq_len "
                              f"{cfg.model.seq_len}", f"shorten it to at most {cfg.model.seq_len} tokens")
    try:
        from tessera.inference.sampling import Sampling

        Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise ConfigError("--temperature", str(e), "give --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1") from None
    if args.cuda_graph == "on" and (cfg.parallel.pp > 1 or args.no_cache):
        raise ConfigError("--cuda-graph", "captures the decode step of one pipeline stage with the KV cache",
                          "use it at parallel.pp=1 without --no-cache, or leave it at auto")
    if args.compile == "on" and (cfg.parallel.pp > 1 or args.no_cache):
        raise ConfigError("--compile", "compiles the decode step of one pipeline stage with the KV cache",
                          "use it at parallel.pp=1 without --no-cache, or leave it at auto")
    return Request(path, meta, cfg, vocab, tokenizer, prompts, texts)


def _prompt_texts(args) -> list[str]:
    if bool(args.prompt) == bool(args.prompts):
        raise ConfigError("--prompt", "give the prompts either as --prompt TEXT or in --prompts FILE",
                          "use one of the two")
    if args.prompt:
        return list(args.prompt)
    fix = 'give a file of JSON lines, each {"prompt": "some text"}'
    try:
        with open(args.prompts, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--prompts", f"cannot read {args.prompts} ({e})", fix) from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["prompt"]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, IndexError):
            raise ConfigError("--prompts", f"{args.prompts} line {number} is not a JSON object with a \"prompt\" "
                              "string", fix) from None
        texts.append(text)
    if not texts:
        raise ConfigError("--prompts", f"{args.prompts} holds no prompt", fix)
    return texts


def run_inference_command(args) -> int:
    """One rank's ``generate`` or ``eval`` (under torchrun: every rank's); rank 0 prints."""
    import torch.distributed as dist

    from tessera.inference.loading import load_chunks
    from tessera.pipeline_parallel.p2p import P2P
    from tessera.topology import Topology
    from tessera.training.launch import init_distributed, pick_device, world_from_env

    rank, local_rank, world = world_from_env()
    request = check_request(args, world)
    cfg = request.cfg
    device = pick_device(cfg.train.device, local_rank)
    init_distributed(device, cfg.train.timeout_s)
    import datetime

    p = cfg.parallel
    topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp, device=device,
                          timeout=datetime.timedelta(seconds=cfg.train.timeout_s))
    chunks = load_chunks(cfg, topo, request.path)
    p2p = P2P(topo) if topo.pp > 1 else None
    if args.command == "generate":
        lines = _generate(args, request, chunks, topo, p2p)
    else:
        lines = _evaluate(args, request, chunks, topo, p2p)
    if dist.is_initialized():  # every replica's lines, to rank 0 (the first replica's first rank)
        gathered = [None] * world
        dist.gather_object(lines if topo.tp_rank == 0 and topo.pp_rank == 0 else None,
                           gathered if rank == 0 else None, dst=0)
        lines = [line for part in gathered or [] if part for line in part]
    if rank == 0:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()
    return 0


def decode_graphed(choice: str, topo, no_cache: bool) -> bool:
    """``--cuda-graph``'s choice for this topology: ``auto`` where measured (CUDA, tp=1, pp=1, the
    KV cache); ``on`` (pp and the cache checked beforehand) or ``off`` as given."""
    if choice == "auto":
        return topo.device.type == "cuda" and topo.tp == 1 and topo.pp == 1 and not no_cache
    return choice == "on"


def decode_compiled(choice: str) -> bool:
    """``--compile``'s choice: ``auto`` is off (a compiled step replays 1.13x faster, but compiling it
    takes longer than a short generation lasts); ``on`` (pp and the cache checked beforehand) or
    ``off`` as given."""
    return choice == "on"


def _generate(args, request: Request, chunks, topo, p2p) -> list[str]:
    """This replica's share of the prompts, generated in batches; one output (text) per prompt."""
    import numpy as np

    from tessera.inference.generate import generate
    from tessera.inference.sampling import Sampling

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    stops = () if args.no_stop else request.vocab.stop_ids
    graph = decode_graphed(args.cuda_graph, topo, args.no_cache)
    compiled = decode_compiled(args.compile)
    share = np.array_split(np.arange(len(request.prompts)), topo.dp)[topo.dp_rank].tolist()
    lines = []
    for start in range(0, len(share), args.batch_size):
        batch = share[start: start + args.batch_size]
        outs = generate(chunks, [request.prompts[i] for i in batch], args.max_new_tokens, topo=topo, p2p=p2p,
                        sampling=sampling, stop_ids=stops, use_cache=not args.no_cache, cuda_graph=graph,
                        compile=compiled)
        for i, ids in zip(batch, outs):
            new = ids[len(request.prompts[i]):]
            ended = bool(new) and new[-1] in stops
            text = request.tokenizer.decode(ids[: len(ids) - ended])
            if args.json:
                completion = request.tokenizer.decode(new[: len(new) - ended])
                lines.append(json.dumps({"prompt": request.texts[i], "completion": completion, "text": text,
                                         "tokens": new, "stop": "end_of_document" if ended else "length"}) + "\n")
            else:
                lines.append(text + "\n" + ("\n" if len(request.prompts) > 1 else ""))
    return lines


def _evaluate(args, request: Request, chunks, topo, p2p) -> list[str]:
    from tessera.inference.perplexity import data_sequences, loss_and_tokens

    cfg = request.cfg
    if args.jsonl:
        sequences, what = request.sequences, args.jsonl
    else:
        sequences = data_sequences(cfg, args.split, args.samples)
        what = f"the {args.split} split of data.source={cfg.data.source}" + (
            f" {','.join(cfg.data.paths)}" if cfg.data.paths else "")
    loss, tokens = loss_and_tokens(chunks, topo, sequences, args.batch_size, p2p)
    if topo.dp_rank:  # (every replica holds the figure; the first says it)
        return []
    mean = loss / max(tokens, 1)
    if args.json:
        return [json.dumps({"loss": mean, "perplexity": math.exp(mean), "tokens": tokens,
                            "sequences": len(sequences)}) + "\n"]
    return [f"tessera: eval {request.path}: loss {mean:.6f} per token, perplexity {math.exp(mean):.4f}, "
            f"over {tokens:,} tokens in {len(sequences):,} sequences of {what}\n"]


__all__ = ["add_inference_commands", "check_request", "run_inference_command"]
