"""Deferred weight gradients (the I / W split of zero-bubble schedules) equal plain backward."""

import torch

from tessera.config import ModelConfig
from tessera.models import GPTModel, TPContext
from tessera.tensor_parallel.wgrad import WeightGradStore


def _grads(model, tokens, store=None, dtype=None):
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
    if store is None:
        loss.backward()
    else:
        with store.defer("mb0"):
            loss.backward()
        deferred = len(store)
        assert deferred > 0
        before = {n: p.grad for n, p in model.named_parameters()}
        assert before["layers.0.attn.qkv.weight"] is None, "I must not compute weight gradients"
        assert before["layers.0.attn_norm.weight"] is not None, "other gradients come with I"
        store.run("mb0")
        assert len(store) == 0
    return {n: p.grad for n, p in model.named_parameters()}


def test_deferred_weight_grads_equal_plain_backward():
    for family, dtype in [("gpt2", None), ("llama", None), ("llama", torch.bfloat16)]:
        cfg = ModelConfig(family=family, hidden=32, heads=4, kv_heads=2 if family == "llama" else 0, layers=2,
                          seq_len=8, vocab_size=40, tie_embeddings=family == "gpt2")
        plain = GPTModel(cfg)
        plain.init_weights(5)
        store = WeightGradStore()
        split = GPTModel(cfg, TPContext(wgrad_store=store))
        split.init_weights(5)
        tokens = torch.randint(0, 40, (2, 8))
        ref, got = _grads(plain, tokens, dtype=dtype), _grads(split, tokens, store, dtype=dtype)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype is None else dict(rtol=2e-2, atol=2e-3)
        for name, grad in ref.items():
            torch.testing.assert_close(got[name], grad, msg=name, **tol)
            assert not got[name].requires_grad, f"{name}: a gradient must not carry a graph"
