"""Evaluation: a model's mean loss per token (and its exponential, the perplexity) over a split of
the data or a JSON-lines file, the same figure on any layout.

Sequences are at most ``seq_len + 1`` tokens (inputs all but the last, labels all but the first):

- **a split of the data** (``data.source`` and ``data.paths`` of the checkpoint's run, or given):
  GPT samples as training reads them (data/gpt_dataset.py), by default one epoch of the split,
  every token a label once; synthetic tokens need a count;
- **a JSON-lines file**: each line's text, tokenized without special tokens, cut into windows of
  ``seq_len + 1`` tokens that share one token (each token a label once).

The dp replicas take contiguous shares of the sequences; each replica runs them in micro-batches
of one length (right-padded, the padding out of the loss: causal attention keeps it out of every
real token's view) through its stages, forward only. The last stage's TP rank 0 sums the loss
and the tokens, and one all-reduce over the world sums them over the replicas.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch
import torch.distributed as dist

from tessera.config import Config, ConfigError
from tessera.pipeline_parallel.p2p import P2P
from tessera.topology import Topology

SPLITS = {"train": 0, "valid": 1, "test": 2}


def file_sequences(path: str, key: str, tokenizer, seq_len: int) -> list[np.ndarray]:
    """The windows of every document of a JSON-lines file (``{key: text}`` per line)."""
    fix = f'give a file of JSON lines, each an object with a "{key}" string (--key names another field)'
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--jsonl", f"cannot read {path} ({e})", fix) from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[key]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, IndexError):
            raise ConfigError("--jsonl", f"{path} line {number} is not a JSON object with a \"{key}\" string",
                              fix) from None
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        out += [ids[start: start + seq_len + 1] for start in range(0, max(len(ids) - 1, 0), seq_len)]
    if not out:
        raise ConfigError("--jsonl", f"{path} holds no document of two tokens or more", fix)
    return out


def split_samples(cfg: Config, split: str, samples: int) -> int:
    """How many samples ``data_sequences`` reads: ``samples``, or 0 for one epoch of the split
    (every token a label once); refused where the split holds no sample or synthetic tokens
    have no count."""
    from tessera.data import IndexedDataset, parse_blend, split_documents

    d = cfg.data
    if d.source == "synthetic":
        if not samples:
            raise ConfigError("--samples", "synthetic tokens never end", "give the number of samples, e.g. --samples 64")
        return samples
    tokens = 0
    for _, prefix in parse_blend(_paths(d)):
        docs = IndexedDataset(prefix)
        taken = split_documents(len(docs), d.split)[SPLITS[split]]
        tokens += int(docs.sequence_lengths[taken.start: taken.stop].sum(dtype=np.int64))
    epoch = (tokens - 1) // cfg.model.seq_len
    if epoch < 1:
        raise ConfigError("--split", f"the {split} split of data.split={d.split} holds {tokens} tokens, not one sample "
                          f"of seq_len + 1 = {cfg.model.seq_len + 1}", "choose another --split, or set data.split")
    return samples or epoch


def _paths(data) -> list[str]:
    from tessera.data.indexed_source import builtin_prefix, default_cache_dir

    return [builtin_prefix(data.cache_dir or default_cache_dir())] if data.source == "builtin" else data.paths


def data_sequences(cfg: Config, split: str, samples: int) -> list[np.ndarray]:
    """``samples`` GPT samples of a split of the config's data (:func:`split_samples`). Every rank
    calls it (indexed datasets build their sample index on rank 0)."""
    from tessera.data import SyntheticTokens
    from tessera.data.indexed_source import indexed_source
    from tessera.tensor_parallel.random import stable_seed

    m, d, part = cfg.model, cfg.data, SPLITS[split]
    count = split_samples(cfg, split, samples)
    if d.source == "synthetic":
        source = SyntheticTokens(m.seq_len, m.vocab_size, cfg.train.seed if part == 0 else
                                 stable_seed(cfg.train.seed, "valid"))
    else:
        source = indexed_source(dataclasses.replace(d, paths=_paths(d)), m.seq_len, count, cfg.train.seed, split=part)
    return [np.asarray(source[i], dtype=np.int64) for i in range(count)]


def _forward(chunks, tokens: torch.Tensor, labels: torch.Tensor, topo: Topology, p2p: P2P | None):
    """One micro-batch through this rank's chunks; its per-token loss [b, s] on the last stage."""
    pp, rank = topo.pp, topo.pp_rank
    last = pp * len(chunks) - 1
    if p2p is not None:
        p2p.new_step(renegotiate=True)  # (micro-batches differ in length)
    loss = None
    for c, chunk in enumerate(chunks):
        stage = c * pp + rank
        x = p2p.recv("F", (rank - 1) % pp, (stage - 1) // pp).wait() if stage > 0 else None
        out = chunk(tokens=tokens if stage == 0 else None, hidden=x, labels=labels if stage == last else None,
                    context_parallel=False)
        if stage < last:
            p2p.send("F", (rank + 1) % pp, c, out)
        else:
            loss = out
    if p2p is not None:
        p2p.wait_sends()
    return loss


@torch.no_grad()
def loss_and_tokens(chunks, topo: Topology, sequences: list[np.ndarray], batch: int,
                    p2p: P2P | None = None) -> tuple[float, int]:
    """(summed loss, tokens) over all of ``sequences``, on every rank; each dp replica runs its
    share. Every rank calls it with the same sequences."""
    share = np.array_split(np.arange(len(sequences)), topo.dp)[topo.dp_rank]
    multiple = chunks[0].tp.size if chunks[0].tp.sequence_parallel else 1
    total = torch.zeros(2, dtype=torch.float64, device=topo.device)
    for start in range(0, len(share), batch):
        rows = [sequences[i] for i in share[start: start + batch]]
        length = -(-max(len(r) - 1 for r in rows) // multiple) * multiple
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        labels, mask = torch.zeros_like(tokens), torch.zeros(len(rows), length)
        for i, row in enumerate(rows):
            row = torch.as_tensor(row)
            tokens[i, : len(row) - 1], labels[i, : len(row) - 1], mask[i, : len(row) - 1] = row[:-1], row[1:], 1.0
        loss = _forward(chunks, tokens.to(topo.device), labels.to(topo.device), topo, p2p)
        if loss is not None and topo.tp_rank == 0:
            mask = mask.to(topo.device)
            total += torch.stack([(loss.double() * mask).sum(), mask.sum().double()])
    if dist.is_initialized():
        dist.all_reduce(total)  # (one contribution per replica: its last stage's TP rank 0)
    return float(total[0]), int(total[1])


__all__ = ["SPLITS", "file_sequences", "split_samples", "data_sequences", "loss_and_tokens"]
