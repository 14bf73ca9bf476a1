"""Who reads the data, and how one step's micro-batches reach every rank that needs them.

- Only TP rank 0 of a stage reads; its TP group receives one step's micro-batches stacked in one
  broadcast (tensor_parallel/data.py).
- The first stage needs the tokens, the last the labels and loss mask; pipeline middle stages
  need nothing, so they read nothing and only count the step's micro-batches (unless packed
  sequences are on: every layer's attention needs the document layout, derived from the tokens).
- Step ``t`` takes the next global batch of samples ``[consumed, consumed + G_t)`` (``G_t`` from
  the batch ramp-up); dp rank ``r`` its ``r``-th contiguous share. Every rank keeps the same
  :class:`MicroBatchCalculator` position, which is what a resumed run restores.
- Packed sequences: positions, document ids and the EOD loss mask are computed from the tokens
  on each rank after the broadcast (models/packed.py), rather than broadcast.
- Heterogeneous stages (stage_topology.py): a pipeline micro-batch is micro_batch x the largest
  stage dp samples, read whole by every stage's TP rank 0, each dp rank keeping its rows (the
  bridge hands activations between stages on the same split).
- Context parallelism: the cp ranks of a dp rank read the same samples; each keeps its two
  chunks of every field along the sequence (context_parallel/chunks.py), computed from the whole
  sample first (document ids and positions run across chunk boundaries).
"""

from __future__ import annotations

import dataclasses

import torch

from tessera.config import Config
from tessera.context_parallel import zigzag
from tessera.data import MicroBatches, SyntheticTokens
from tessera.data.indexed_source import builtin_prefix, default_cache_dir, indexed_source
from tessera.models.packed import document_fields
from tessera.optim import MicroBatchCalculator
from tessera.tensor_parallel import broadcast_batch
from tessera.tensor_parallel.random import stable_seed
from tessera.topology import Topology


def total_samples(cfg: Config) -> int:
    """Samples the whole run consumes (the ramp-up included)."""
    calc = MicroBatchCalculator.from_config(cfg.train, cfg.parallel.dp)
    for _ in range(cfg.train.steps):
        calc.advance()
    return calc.consumed_samples


def eval_samples(cfg: Config) -> int:
    """Samples the validation split is built for: Megatron-LM's count for a run of train.steps,
    ``(steps // eval_every + 1) * eval_batches * global_batch`` (its evaluations read on through
    the split; tessera's each read the first ``eval_batches`` global batches of that stream)."""
    t = cfg.train
    evaluations = t.steps // t.eval_every + 1 if t.eval_every > 0 else 1
    return evaluations * t.eval_batches * t.global_batch


def build_source(cfg: Config, split: int = 0):
    """The sample source of the training (``split`` 0) or validation (1) data: ``source[i]`` is
    sample i, ``seq_len + 1`` token ids. Every rank calls it (indexed datasets build their sample
    index on rank 0 while the others wait)."""
    m, t, d = cfg.model, cfg.train, cfg.data
    if d.source == "synthetic":  # validation: a stream of its own
        return SyntheticTokens(m.seq_len, m.vocab_size, t.seed if split == 0 else stable_seed(t.seed, "valid"))
    if d.source == "builtin":  # the demo corpus, through the same indexed path
        d = dataclasses.replace(d, paths=[builtin_prefix(d.cache_dir or default_cache_dir())])
    return indexed_source(d, m.seq_len, total_samples(cfg) if split == 0 else eval_samples(cfg), t.seed, split=split)


class DataFeed:
    """The training data (``split`` 0), or the validation data (1: a constant train.global_batch,
    no ramp-up)."""

    def __init__(self, cfg: Config, topo: Topology, split: int = 0):
        self.cfg, self.topo = cfg, topo
        d = cfg.data
        self.packing = d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss
        self.reads = topo.is_first_stage or topo.is_last_stage or self.packing
        t = cfg.train
        # heterogeneous stages: the whole pipeline micro-batch on every stage, sliced into its dp rows
        micro_batch, dp = (t.micro_batch * cfg.parallel.dp, 1) if topo.heterogeneous else (t.micro_batch, topo.dp)
        self.batches = MicroBatchCalculator(t.global_batch, micro_batch, dp, t.rampup if split == 0 else None)
        self.loader = None
        self.header = None  # each field's key, per-micro-batch shape and dtype, after the first step
        source = build_source(cfg, split)  # on every rank: index building waits for rank 0
        if self.reads and topo.tp_rank == 0:
            self.loader = MicroBatches(source, batches=self.batches, dp_rank=0 if topo.heterogeneous else topo.dp_rank,
                                       vocab_size=cfg.model.vocab_size)

    def next(self) -> list[dict]:
        """This rank's micro-batches of the next step (empty dicts on pipeline middle stages)."""
        count = self.batches.num_micro_batches(self.batches.consumed_samples)
        if not self.reads:
            self.batches.advance()
            return [{} for _ in range(count)]
        stacked = None
        if self.loader is not None:
            batches = next(self.loader)  # advances self.batches
            stacked = {k: torch.stack([mb[k] for mb in batches]) for k in batches[0]}
        else:
            self.batches.advance()
        # after the first step every TP rank knows the header: the keys and dtypes stay, the
        # micro-batch count follows the calculator (no host round trip in the broadcast)
        header = None if self.header is None else [(k, (count, *shape), dtype) for k, shape, dtype in self.header]
        stacked = broadcast_batch(stacked, self.topo.group("tp"), self.topo.tp_src_rank, self.topo.device, header)
        self.header = [(k, tuple(v.shape[1:]), v.dtype) for k, v in stacked.items()]
        if self.packing:
            stacked = self._add_document_fields(stacked)
        if self.topo.heterogeneous and self.topo.dp > 1:  # this dp rank's rows: [m, B, s] -> [m, B / dp, s]
            rows = next(iter(stacked.values())).shape[1] // self.topo.dp
            stacked = {k: v[:, self.topo.dp_rank * rows:(self.topo.dp_rank + 1) * rows] for k, v in stacked.items()}
        if self.topo.cp > 1:  # this rank's chunks of each sample: [m, b, s] -> [m, b, 2s / 2cp]
            stacked = {k: zigzag(v, self.topo.cp_rank, self.topo.cp, dim=2) for k, v in stacked.items()}
        count = next(iter(stacked.values())).shape[0]
        return [{k: v[i] for k, v in stacked.items()} for i in range(count)]

    def _add_document_fields(self, stacked: dict) -> dict:
        d = self.cfg.data
        m, b, s = stacked["tokens"].shape
        fields = document_fields(stacked["tokens"].reshape(m * b, s), d.eod_id,
                                 reset_position_ids=d.reset_position_ids,
                                 reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss)
        out = dict(stacked)
        for key, value in fields.items():
            if key == "eod_loss_mask":
                out["loss_mask"] = stacked["loss_mask"] * value.view(m, b, s)
            else:
                out[key] = value.view(m, b, s)
        return out

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)
