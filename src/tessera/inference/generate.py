"""Generation from a tensor- and pipeline-parallel model, with a KV cache (models/kv_cache.py).

The plan of one call; every rank of a dp replica runs it alike, with the same prompts:

1. **Batch.** The prompts are left-padded to one length P (under sequence parallelism P is a
   multiple of tp, and the batch is rounded up to one with dummy rows); a prompt longer than
   model.seq_len keeps its last seq_len tokens.
2. **Prefill.** The padded prompts go through the stages once; each layer writes its keys and
   values into its preallocated cache; the last stage gathers the last position's logits over TP,
   and every TP rank there draws the same tokens (inference/sampling.py).
3. **Decode**, one token per sequence per step: the last stage broadcasts the drawn tokens to
   the other pipeline ranks, the first stage embeds them, each layer writes one slot of its cache
   and attends to it. The tokens stay on the device until the end: with stop ids, whether every
   sequence has ended is read every few steps, the loop's one host read. ``cuda_graph`` (CUDA,
   pp=1): each step is one replay of a captured graph (inference/decode_graph.py); ``compile``
   (pp=1): the step is compiled by inductor first, captured or (without the graph) run as it is.
4. **Past model.seq_len** tokens the model has no positions left: the context becomes the last
   seq_len tokens, prefilled again for each new token (as the run's closing sample always did).

``use_cache=False`` is the reference path: each step runs the whole context through the plain
forward (padding kept apart as a document of its own, models/packed.py), sampled alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from tessera.inference.decode_graph import DecodeGraph, compile_step
from tessera.inference.sampling import Sampling, next_tokens
from tessera.models.gpt import GPTModel
from tessera.models.kv_cache import KVCache
from tessera.pipeline_parallel.p2p import P2P
from tessera.tensor_parallel.mappings import gather_from_tp_region
from tessera.topology import Topology

CHECK_ENDED_EVERY = 16  # decode steps between reads of "has every sequence ended?"


@torch.no_grad()
def generate(chunks: list[GPTModel], prompts: list[list[int]], max_new_tokens: int, *, topo: Topology,
             p2p: P2P | None = None, sampling: Sampling = Sampling(), stop_ids: tuple[int, ...] = (),
             use_cache: bool = True, cuda_graph: bool = False, compile: bool = False) -> list[list[int]]:
    """Each prompt (token ids) followed by up to ``max_new_tokens`` new ids, ending after the first
    of ``stop_ids`` it draws; every rank of the replica returns the same lists. The chunks run in
    eval mode and are put back as they were, also after an error; a trainer's ``p2p`` (shapes
    kept for the run) renegotiates its shapes at the next training step."""
    vocab = chunks[0].cfg.vocab_size
    if not prompts or not all(prompts):
        raise ValueError("generate needs prompts of at least one token id each")
    bad = [t for prompt in prompts for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the model's vocabulary [0, {vocab})")
    if max_new_tokens < 0:
        raise ValueError(f"generate needs max_new_tokens >= 0, got {max_new_tokens}")
    if cuda_graph and not (use_cache and topo.device.type == "cuda" and topo.pp == 1):
        raise ValueError("a CUDA-graphed decode step needs the KV cache, a CUDA device and pp=1")
    if compile and not (use_cache and topo.pp == 1):
        raise ValueError("a compiled decode step needs the KV cache and pp=1")
    was_training = chunks[0].training
    for chunk in chunks:
        chunk.eval()
    try:
        run = _Generation(chunks, topo, p2p, sampling, stop_ids, use_cache, cuda_graph, compile)
        return run.generate([list(p) for p in prompts], max_new_tokens)
    finally:
        for chunk in chunks:
            chunk.train(was_training)
            for module in chunk.modules():  # zero=3: FSDP keeps a root unsharded after a forward
                if isinstance(module, FSDPModule):
                    module.reshard()
        if p2p is not None and p2p.failed is None:  # the next training step sends its own shapes again
            p2p.new_step(renegotiate=True)


def _cut(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """The tokens up to and including the first stop id."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


class _Generation:
    """One call's state: the cache, the host's count of its slots, the sampling generator."""

    def __init__(self, chunks: list[GPTModel], topo: Topology, p2p: P2P | None, sampling: Sampling,
                 stop_ids: tuple[int, ...], use_cache: bool, cuda_graph: bool, compile: bool):
        self.chunks, self.topo, self.p2p, self.sampling = chunks, topo, p2p, sampling
        self.stop_ids, self.use_cache = tuple(stop_ids), use_cache
        self.cuda_graph, self.compile = cuda_graph, compile
        first = chunks[0]
        self.seq_len, self.vocab = first.cfg.seq_len, first.cfg.vocab_size
        self.multiple = first.tp.size if first.tp.sequence_parallel else 1  # SP splits sequences over tp
        self.device = topo.device
        self.generator = torch.Generator(self.device).manual_seed(sampling.seed)
        self.cache: KVCache | None = None
        self.slot, self.pads = 0, []  # the next decode step's slot, each row's padding (host copies)
        self.step = None  # the graphed or compiled decode step, built at the first decode after a prefill
        self.shapes_known = False  # the decode steps' pipeline messages have negotiated their shape

    # -- the loop -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        if max_new == 0:
            return prompts
        n = len(prompts)
        rows = prompts + [[0]] * (-n % self.multiple)  # (dummy rows: the batch splits over tp under SP)
        new = torch.zeros(len(rows), max_new, dtype=torch.long, device=self.device)
        ended = torch.zeros(n, dtype=torch.bool, device=self.device)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device) if self.stop_ids else None
        logits = self.prefill(rows, max_new) if self.use_cache else self.whole_context(rows)
        steps = 0
        for step in range(max_new):
            token = self.draw(logits, n)
            new[:, step] = token
            steps = step + 1
            if steps == max_new:
                break
            if stops is not None:
                ended |= torch.isin(token[:n], stops)
                if steps % CHECK_ENDED_EVERY == 0 and bool(ended.all()):
                    break
            if not self.use_cache:
                logits = self.whole_context(self.rows_now(rows, new, steps))
            elif self.slot - min(self.pads) < self.seq_len and self.slot < self.cache.capacity:
                logits = self.decode(token)
            else:  # a position past model.seq_len: the last seq_len tokens again, from scratch
                logits = self.prefill(self.rows_now(rows, new, steps), max_new)
        drawn = new[:n, :steps].tolist()
        return [prompt + _cut(tokens, self.stop_ids) for prompt, tokens in zip(prompts, drawn)]

    @staticmethod
    def rows_now(rows: list[list[int]], new: torch.Tensor, steps: int) -> list[list[int]]:
        return [row + tokens for row, tokens in zip(rows, new[:, :steps].tolist())]

    def draw(self, logits: torch.Tensor | None, n: int) -> torch.Tensor:
        """The next token of every row, on every rank: drawn on the last stage for the ``n`` real
        rows (dummy rows draw nothing, so the draws are the same at any tp), broadcast over pp."""
        token = torch.zeros(len(self.pads), dtype=torch.long, device=self.device)
        if logits is not None:
            token[:n] = next_tokens(logits[:n], self.sampling, self.generator)
        if self.topo.pp > 1:
            dist.broadcast(token, self.topo.ranks_of("pp")[-1], group=self.topo.group("pp"))
        return token

    # -- the three kinds of forward -----------------------------------------------------------------
    def left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """The last seq_len tokens of each row, left-padded to one length: (tokens [b, P], pads)."""
        contexts = [row[-self.seq_len:] for row in rows]
        longest = max(map(len, contexts))
        length = -(-longest // self.multiple) * self.multiple
        pads = [length - len(c) for c in contexts]
        tokens = torch.tensor([[0] * pad + c for pad, c in zip(pads, contexts)], dtype=torch.long)
        return tokens.to(self.device), pads

    def prefill(self, rows: list[list[int]], max_new: int) -> torch.Tensor | None:
        tokens, self.pads = self.left_padded(rows)
        length = tokens.shape[1]
        if self.cache is None:  # room for the prompts and the new tokens, or up to the last position
            capacity = max(length, min(length + max_new - 1, self.seq_len + self.multiple - 1))
            self.cache = KVCache.for_chunks(self.chunks, len(rows), capacity)
        self.shapes_known, self.step, self.slot = False, None, length
        logits = self.forward(tokens, cache=self.cache.prefill(self.pads, length))
        return None if logits is None else logits[-1]

    def decode(self, token: torch.Tensor) -> torch.Tensor | None:
        if self.cuda_graph or self.compile:
            if self.step is None:
                step = compile_step(self.static_decode) if self.compile else self.static_decode
                self.step = DecodeGraph(step, token, warmups=2 if self.compile else 1) if self.cuda_graph else step
            logits = self.step(token)
        else:
            logits = self.forward(token.view(1, -1), cache=self.cache.decode(self.slot + 1))
            logits = None if logits is None else logits[:, 0]  # [b, 1, vocab]: the b tokens in a row
        self.cache.slot += 1
        self.slot += 1
        return logits

    def static_decode(self, token: torch.Tensor) -> torch.Tensor:
        """A decode step of static shapes, attending over the cache's whole capacity (masked to the
        valid slots): what a CUDA graph replays and inductor compiles once per batch and capacity."""
        return self.forward(token.view(1, -1), cache=self.cache.decode())[:, 0]

    def whole_context(self, rows: list[list[int]]) -> torch.Tensor | None:
        """The reference: the whole context through the plain forward, padding a document of its own."""
        tokens, self.pads = self.left_padded(rows)
        self.shapes_known = False
        packed = {}
        if max(self.pads):
            slots = torch.arange(tokens.shape[1], device=self.device)
            pads = torch.tensor(self.pads, device=self.device)[:, None]
            packed = {"position_ids": (slots - pads).clamp_min(0), "document_ids": (slots >= pads).long()}
        logits = self.forward(tokens, **packed)
        return None if logits is None else logits[-1]

    def forward(self, tokens: torch.Tensor, **inputs) -> torch.Tensor | None:
        """``tokens`` through this rank's chunks (the first stage embeds them, later stages receive
        the hidden stream); the logits gathered over TP [s, b, vocab] on the last stage, else None."""
        pp, rank, p2p = self.topo.pp, self.topo.pp_rank, self.p2p
        last = pp * len(self.chunks) - 1
        if p2p is not None and not self.shapes_known:  # a new shape: headers first (decode: once)
            p2p.new_step(renegotiate=True)
            self.shapes_known = "cache" in inputs and not inputs["cache"].last_only
        logits = None
        for c, chunk in enumerate(self.chunks):
            stage = c * pp + rank
            x = p2p.recv("F", (rank - 1) % pp, (stage - 1) // pp).wait() if stage > 0 else None
            out = chunk(tokens=tokens if stage == 0 else None, hidden=x, context_parallel=False, **inputs)
            if stage < last:
                p2p.send("F", (rank + 1) % pp, c, out)
            else:
                logits = gather_from_tp_region(out, chunk.tp.group)[..., : self.vocab]
        if p2p is not None:
            p2p.wait_sends()
        return logits


__all__ = ["generate", "Sampling"]
