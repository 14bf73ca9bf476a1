"""The data subcommands of the ``tessera`` command line.

``tessera preprocess --input FILE.jsonl[.gz]|DIR --key text --tokenizer SPEC --output-prefix P
[--workers N] [--vocab-size V] [--eod-token TOKEN] [--overwrite]`` writes ``P.bin``, ``P.idx`` and
the tokenizer as ``P.tokenizer.json`` (SPEC: a tokenizer.json, a folder holding one, or ``bpe:V``
to train a byte-level BPE on the input).

``tessera data inspect P [--show N]`` prints the pair's counts and dtype (and the end-of-document
id, where every document sampled ends with the same one), and with ``--show N`` document N's token
ids as a JSON list.

Kept apart from ``cli.py`` so the trainer's command line does not import the tokenizers library,
and this module imports nothing heavy until a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_data_commands(sub) -> None:
    """Register ``preprocess`` and ``data inspect`` on the ``tessera`` subparsers."""
    pre = sub.add_parser("preprocess", help="tokenize JSON lines into a Megatron .bin/.idx pair")
    pre.add_argument("--input", required=True,
                     help="JSON Lines (one object per line): a .jsonl or .jsonl.gz file, or a directory of them")
    pre.add_argument("--key", default="text", help="the JSON key holding each document's text (default: text)")
    pre.add_argument("--tokenizer", required=True, metavar="SPEC",
                     help="tokenizer.json, a folder containing one, or bpe:V to train a byte-level BPE of V ids")
    pre.add_argument("--output-prefix", required=True, metavar="P", help="writes P.bin, P.idx and P.tokenizer.json")
    pre.add_argument("--workers", type=int, default=1, help="processes that parse and encode")
    pre.add_argument("--vocab-size", type=int, metavar="V",
                     help="vocabulary size for the token dtype, at least the tokenizer's (default: the "
                          "tokenizer's); with --tokenizer bpe (no :V), also the size to train")
    pre.add_argument("--eod-token", metavar="TOKEN",
                     help="the end-of-document token (default: <|endoftext|>, </s>, ... whichever exists)")
    pre.add_argument("--overwrite", action="store_true", help="replace P.bin, P.idx and P.tokenizer.json if they exist")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    data = sub.add_parser("data", help="look into indexed datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    inspect = data_sub.add_parser("inspect", help="documents, sequences, tokens and dtype of PREFIX.bin/.idx")
    inspect.add_argument("prefix", help="the path without .bin/.idx")
    inspect.add_argument("--show", type=int, metavar="N", help="print document N's token ids as a JSON list")


def run_data_command(args: argparse.Namespace) -> int:
    """Run ``preprocess`` or ``data inspect``; a bad input is one line on stderr and exit status 2."""
    from tessera.data.indexed import IndexedDatasetError
    from tessera.data.preprocess import PreprocessError

    try:
        if args.command == "preprocess":
            return _preprocess(args)
        return _inspect(args)
    except (IndexedDatasetError, PreprocessError) as e:
        print(f"tessera: {e}", file=sys.stderr)
        return 2


def _preprocess(args: argparse.Namespace) -> int:
    from tessera.data.preprocess import preprocess

    r = preprocess(args.input, args.output_prefix, args.tokenizer, key=args.key, workers=args.workers,
                   vocab_size=args.vocab_size, eod_token=args.eod_token, progress=not args.no_progress,
                   overwrite=args.overwrite)
    rate = r.input_bytes / 1e6 / max(r.seconds, 1e-9)
    print(f"{r.documents} documents, {r.tokens} tokens ({r.dtype}, vocab {r.vocab_size}, eod {r.eod_id}) "
          f"in {r.seconds:.1f}s ({r.documents / max(r.seconds, 1e-9):,.0f} docs/s, {rate:.1f} MB/s): "
          f"{r.bin_path}, {r.idx_path}, tokenizer {r.tokenizer_path}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from tessera.data.indexed import IndexedDataset

    ds = IndexedDataset(args.prefix)
    if args.show is not None:
        if not 0 <= args.show < ds.num_documents:
            print(f"tessera: --show {args.show}: out of range, {args.prefix} has {ds.num_documents} documents",
                  file=sys.stderr)
            return 2
        print(json.dumps(ds.document(args.show).tolist()))
        return 0
    print(f"{args.prefix}: documents {ds.num_documents}, sequences {len(ds)}, tokens {ds.num_tokens}, "
          f"dtype {ds.dtype}{_end_of_document(ds)}")
    return 0


def _end_of_document(ds, samples: int = 1000) -> str:
    """", eod N" where every one of up to ``samples`` documents (spread over the corpus) ends with
    id N, the end-of-document token ``tessera preprocess`` appends (data.eod_id for packing);
    else nothing."""
    from tessera.data.indexed import document_ends

    ends = document_ends(ds, samples)
    return f", eod {ends.pop()} (every document sampled ends with it)" if len(ends) == 1 else ""
