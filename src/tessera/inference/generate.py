"""Sampling from a tensor- and pipeline-parallel model, for the demo's closing sample.

Every TP rank of the last stage runs the same forward pass, gathers the full logits of the last
position and draws with an identically seeded generator, so they agree without communication;
with pipeline stages the context flows through the stages (forward only) and the last stage
broadcasts the drawn token to the others. There is no KV cache: the context is re-run each step,
which is fine for a short sample.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.models.gpt import GPTModel
from tessera.pipeline_parallel.p2p import P2P
from tessera.tensor_parallel.mappings import gather_from_tp_region
from tessera.topology import Topology


def _last_stage_logits(chunks: list[GPTModel], tokens: torch.Tensor, topo: Topology,
                       p2p: P2P | None) -> torch.Tensor | None:
    """Forward ``tokens`` [1, s] through the pipeline; full logits [1, s, vocab] on the last stage."""
    pp, rank = topo.pp, topo.pp_rank
    last = pp * len(chunks) - 1
    if p2p is not None:
        p2p.new_step(renegotiate=True)  # each call's context has its own length
    logits = None
    for c, chunk in enumerate(chunks):
        stage = c * pp + rank
        x = p2p.recv("F", (rank - 1) % pp, (stage - 1) // pp).wait() if stage > 0 else None
        out = chunk(tokens=tokens if stage == 0 else None, hidden=x, context_parallel=False)  # whole contexts
        if stage < last:
            p2p.send("F", (rank + 1) % pp, c, out)
        else:
            full = gather_from_tp_region(out, chunk.tp.group)[..., : chunk.cfg.vocab_size]
            logits = full.transpose(0, 1)
    if p2p is not None:
        p2p.wait_sends()
    return logits


@torch.no_grad()
def generate(chunks: list[GPTModel], prompt: list[int], new_tokens: int, *, topo: Topology,
             p2p: P2P | None = None, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Extend ``prompt`` by ``new_tokens`` sampled ids; every rank returns the same list. The
    chunks run in eval mode and are put back as they were, also after an error; a trainer's
    ``p2p`` (shapes kept for the run) renegotiates its shapes at the next training step."""
    vocab = chunks[0].cfg.vocab_size
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token id")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the model's vocabulary [0, {vocab})")
    if new_tokens < 0 or top_k < 0 or not temperature >= 0:
        raise ValueError(f"generate needs new_tokens >= 0, top_k >= 0 (0: no cut) and temperature >= 0, "
                         f"got {new_tokens}, {top_k}, {temperature}")
    was_training = chunks[0].training
    for chunk in chunks:
        chunk.eval()
    try:
        return _sample(chunks, list(prompt), new_tokens, topo, p2p, temperature, top_k, seed)
    finally:
        for chunk in chunks:
            chunk.train(was_training)
        if p2p is not None and p2p.failed is None:  # the next training step sends its own shapes again
            p2p.new_step(renegotiate=True)


def _sample(chunks: list[GPTModel], ids: list[int], new_tokens: int, topo: Topology, p2p: P2P | None,
            temperature: float, top_k: int, seed: int) -> list[int]:
    device = topo.device
    generator = torch.Generator(device).manual_seed(seed)
    # (padding only under sequence parallelism: elsewhere it would cut the context to fit seq_len)
    tp = topo.tp if chunks[0].tp.sequence_parallel else 1
    seq_len = chunks[0].cfg.seq_len
    last_rank = topo.ranks_of("pp")[-1]
    for _ in range(new_tokens):
        context = ids[-seq_len:]
        # Under sequence parallelism the length must divide by tp: pad on the right, which a
        # causal model cannot see from the position we read.
        padded = context + [0] * (-len(context) % tp)
        if len(padded) > seq_len:
            context, padded = context[tp:], padded[tp:]
        logits = _last_stage_logits(chunks, torch.tensor([padded], device=device), topo, p2p)
        token = torch.zeros(1, dtype=torch.int64, device=device)
        if logits is not None:
            logits = logits[0, len(context) - 1].float()
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        if topo.pp > 1:
            dist.broadcast(token, last_rank, group=topo.group("pp"))
        ids.append(int(token))
    return ids
