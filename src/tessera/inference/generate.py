"""Sampling from a (tensor-parallel) model, for the demo's closing sample.

Every rank of the TP group runs the same forward pass, gathers the full logits of the last
position and draws with an identically seeded generator, so all ranks agree on every token
without extra communication. No KV cache yet: the context is re-run each step (fine for a
short sample; the inference issue adds the cache).
"""

from __future__ import annotations

import torch

from tessera.models.gpt import GPTModel


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0) -> list[int]:
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model on this rank (pp=1)")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    ids = list(prompt)
    tp, seq_len = model.tp.size, model.cfg.seq_len
    for _ in range(new_tokens):
        context = ids[-seq_len:]
        # Under sequence parallelism the length must divide by tp: pad on the right, which a
        # causal model cannot see from the position we read.
        padded = context + [0] * (-len(context) % tp)
        if len(padded) > seq_len:
            context, padded = context[tp:], padded[tp:]
        logits = model.full_logits(torch.tensor([padded], device=device))[0, len(context) - 1].float()
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    model.train(was_training)
    return ids
