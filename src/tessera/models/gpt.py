"""The decoder: GPT-2 and Llama from one class, whole or as one pipeline stage.

A stage holds layers ``layer_range`` (global indices, so parameter names and their seeded
initialisation are the same whatever the pipeline layout), the embedding only when it is the
first stage (``pre_process``) and the final norm, output layer and loss only when it is the
last (``post_process``). With tied embeddings on a single stage the output layer reuses the
embedding matrix; a last stage without the embedding holds its own copy, initialised from the
same seed (the pipeline keeps the two equal by reducing their gradients together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.config import ModelConfig
from tessera.models.kv_cache import Decode, Prefill
from tessera.models.packed import PackedSequence
from tessera.models.transformer import TPContext, TransformerLayer, build_norm
from tessera.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tessera.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    init_vocab_rows,
    padded_vocab_size,
)
from tessera.context_parallel import positions
from tessera.tensor_parallel.mappings import gather_from_tp_region, group_rank, group_size, scatter_to_sequence_region
from tessera.tensor_parallel.random import SelectivePolicy, recompute, stable_seed
from tessera.tensor_parallel.wgrad import WeightGradStore


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext | None = None, *, layer_range: range | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 device: torch.device | str | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp or TPContext()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = range(cfg.layers) if layer_range is None else layer_range
        if self.tp.sequence_parallel and cfg.seq_len % self.tp.size:
            raise ValueError(f"seq_len {cfg.seq_len} is not divisible by tp={self.tp.size} (sequence parallel)")
        tp_group, std = self.tp.group, cfg.init_std
        if pre_process:
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, tp_group=tp_group,
                                                    pad_multiple=cfg.vocab_pad_multiple, init_std=std,
                                                    device=device)
            if cfg.family == "gpt2":
                self.pos_embedding = nn.Embedding(cfg.seq_len, cfg.hidden, device=device)
        # Keys are global layer indices: "layers.7" is the same layer on any pipeline layout.
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, self.tp, device) for i in self.layer_range})
        # how many of these layers, from the first, keep only their input and run again in the
        # backward (train.recompute; tensor_parallel/random.py's recompute), and with a policy what
        # else they keep (selective: the GEMMs' and attention's outputs)
        self.recompute_layers = 0
        self.recompute_policy: SelectivePolicy | None = None
        self.wgrad_store: WeightGradStore | None = None  # (use_weight_grad_store)
        if post_process:
            self.final_norm = build_norm(cfg, self.tp, device)
            # Tied on a single stage: the output layer is the embedding matrix (see logits()).
            self.output = None
            if not (cfg.tie_embeddings and pre_process):
                self.output = ColumnParallelLinear(
                    cfg.hidden, padded_vocab_size(cfg.vocab_size, self.tp.size, cfg.vocab_pad_multiple),
                    tp_group=tp_group, bias=False, sequence_parallel=self.tp.sequence_parallel,
                    init_std=std, comm_overlap=self.tp.comm_overlap, device=device)
                if cfg.tie_embeddings:  # this stage's copy of the first stage's embedding
                    self.output.weight.tied_across_stages = True
                    self.output.weight.shared_embedding = True  # norms count it on the first stage
        if pre_process and cfg.tie_embeddings and not post_process:
            self.embedding.weight.tied_across_stages = True

    def use_weight_grad_store(self, store: WeightGradStore | None) -> None:
        """Run every linear layer's weight gradient through ``store``: deferred by zero-bubble
        schedules, fused into the main gradients, into the store's sink (None: autograd's own).
        A fusing store takes the embedding's lookup gradient too, unless the embedding is also
        this stage's output layer (tied: autograd sums its two terms, see :meth:`logits`)."""
        self.wgrad_store = store
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.wgrad_store = store
        if self.pre_process and not (self.post_process and self.output is None):
            self.embedding.wgrad_store = store

    # -- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from ``seed`` and its layout-independent name."""
        def gen(name: str) -> torch.Generator:
            device = next(self.parameters()).device
            return torch.Generator(device).manual_seed(stable_seed(seed, name))

        std = self.cfg.init_std
        if self.pre_process:
            self.embedding.reset_parameters(gen("embedding"))
            if hasattr(self, "pos_embedding"):
                self.pos_embedding.weight.normal_(0.0, std, generator=gen("pos_embedding"))
        for name, module in self.layers.named_modules(prefix="layers"):
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.reset_parameters(gen(name))
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        if self.post_process:
            self.final_norm.reset_parameters()
            if self.output is not None:
                # A pipeline's last stage with tied embeddings holds a copy of the embedding.
                name = "embedding" if self.cfg.tie_embeddings else "output"
                init_vocab_rows(self.output.weight, self.cfg.vocab_size, std, self.tp.group, gen(name))

    # -- forward --------------------------------------------------------------------------------
    def embed(self, tokens: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """tokens [b, s] -> residual stream [s, b, h] (or [s/tp, b, h] under sequence parallel).
        Without ``position_ids`` the tokens are positions 0 .. s-1, so s <= model.seq_len."""
        if tokens.dim() != 2 or (position_ids is None and tokens.shape[1] > self.cfg.seq_len):
            raise ValueError(f"tokens must be [batch, seq] with seq <= model.seq_len = {self.cfg.seq_len}, "
                             f"got shape {tuple(tokens.shape)}")
        x = self.embedding(tokens.t())  # [s, b, h]
        if hasattr(self, "pos_embedding"):
            if position_ids is None:
                x = x + self.pos_embedding.weight[: tokens.shape[1]].unsqueeze(1)
            else:  # packed sequences: positions restart per document
                x = x + self.pos_embedding.weight[position_ids.t()]
        if self.tp.sequence_parallel:
            x = scatter_to_sequence_region(x, self.tp.group)
        if self.training and self.cfg.dropout:
            with self.tp.residual_region():
                x = F.dropout(x, self.cfg.dropout, training=True)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """Residual stream -> this rank's logit slice [s, b, padded_vocab / tp].

        A tied output layer's weight is the embedding, whose gradient has a second term from the
        lookup, so it is not fused into main_grad (autograd sums the two before the gradient
        hook); zero-bubble schedules, which would defer one term, need pp >= 2, where the two
        are different parameters."""
        x = self.final_norm(x)
        if self.output is not None:
            return self.output(x)
        return column_parallel_linear(x, self.embedding.weight, None, self.tp.group, self.tp.sequence_parallel,
                                      wgrad_store=self.wgrad_store, fuse_wgrad=False,
                                      comm_overlap=self.tp.comm_overlap)

    def forward(self, tokens: Tensor | None = None, labels: Tensor | None = None,
                hidden: Tensor | None = None, position_ids: Tensor | None = None,
                document_ids: Tensor | None = None, *, context_parallel: bool = True,
                cache: Prefill | Decode | None = None):
        """First stage: ``tokens`` [b, s]; later stages: ``hidden`` from the previous stage.
        Packed sequences (every stage): ``position_ids`` and ``document_ids`` [b, s] (models/packed.py).
        With a context-parallel group (``TPContext.cp_group``) the inputs are this rank's two chunks
        of each sample (context_parallel/chunks.py), attended by ring attention;
        ``context_parallel=False``: they are whole samples (generation), attended here.
        ``cache``: a step of generation with a KV cache (models/kv_cache.py), which brings the
        positions and each layer's attention through the cache (whole samples).

        Last stage with ``labels`` [b, s]: per-token loss [b, s] (fp32). Last stage without
        labels: local logits [s, b, padded_vocab / tp] (of the last position only for a prefill:
        [1, b, ...], or [tp, b, ...] under sequence parallelism, the last row being the
        sequence's last). Other stages: the hidden stream."""
        if cache is not None:
            context_parallel, position_ids = False, cache.position_ids
        cp = self.tp.cp_group if context_parallel and group_size(self.tp.cp_group) > 1 else None
        if cp is not None and position_ids is None:  # this rank's tokens' places in the sample
            b, s = tokens.shape if tokens is not None else (hidden.shape[1], hidden.shape[0] * (
                self.tp.size if self.tp.sequence_parallel else 1))
            where = positions(s * group_size(cp), group_rank(cp), group_size(cp), (tokens if tokens is not None
                                                                                 else hidden).device)
            position_ids = where.expand(b, s)
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        seq = PackedSequence(position_ids, document_ids, cp_group=cp)
        for i, (index, layer) in enumerate(self.layers.items()):
            if cache is not None:
                x = layer(x, cache.layer(int(index)))  # this layer's keys and values, through the cache
            elif i < self.recompute_layers and torch.is_grad_enabled():
                x = recompute(layer, x, seq, tracker=self.tp.rng, policy=self.recompute_policy)
            else:
                x = layer(x, seq)
        if not self.post_process:
            return x
        if cache is not None and cache.last_only:  # (under SP each rank's last row: gathered, the
            x = x[-1:]                              # output layer's last row is the sequence's last)
        logits = self.logits(x)
        if labels is None:
            return logits
        # [s, b] -> [b, s]; a copy (tiny), never a view, also where b = 1 makes the transpose
        # contiguous already (FSDP warns about returned views)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp.group, self.cfg.vocab_size,
                                            fused=self.tp.fused_cross_entropy)
        return loss.t().clone(memory_format=torch.contiguous_format)

    @torch.no_grad()
    def full_logits(self, tokens: Tensor) -> Tensor:
        """[b, s] -> [b, s, vocab_size] gathered over TP (for generation and tests)."""
        logits = gather_from_tp_region(self(tokens, context_parallel=False), self.tp.group)  # (pre-hooks run)
        return logits[..., : self.cfg.vocab_size].transpose(0, 1)

