"""Deferred weight gradients (the I / W split of zero-bubble schedules) equal plain backward."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models import GPTModel
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
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
        split = GPTModel(cfg)
        split.use_weight_grad_store(store)
        split.init_weights(5)
        tokens = torch.randint(0, 40, (2, 8))
        ref, got = _grads(plain, tokens, dtype=dtype), _grads(split, tokens, store, dtype=dtype)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype is None else dict(rtol=2e-2, atol=2e-3)
        for name, grad in ref.items():
            torch.testing.assert_close(got[name], grad, msg=name, **tol)
            assert not got[name].requires_grad, f"{name}: a gradient must not carry a graph"


# -- gradient-accumulation fusion ---------------------------------------------------------------

def test_wgrad_into_fused_equals_reference():
    """The fused GEMM (addmm into the accumulator) and the reference (matmul, then add or copy)."""
    from tessera.tensor_parallel.wgrad import wgrad_into
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 20, generator=g), torch.randn(20, 5, generator=g)
    for accumulate in (False, True):
        start = torch.randn(6, 5, generator=g)
        fused, ref = start.clone(), start.clone()
        wgrad_into(fused, a, b, accumulate, fused=True)
        wgrad_into(ref, a, b, accumulate, fused=False)
        torch.testing.assert_close(fused, ref)
        torch.testing.assert_close(ref, a @ b + (start if accumulate else 0))


def _main_grads(cfg, fuse: bool, dtype: torch.dtype):
    from tessera.distributed.data_parallel import DataParallel
    from tessera.topology import Topology
    model = GPTModel(cfg).to(dtype)
    model.init_weights(5)
    dp = DataParallel([model], Topology.build(), param_dtype=dtype)
    model.use_weight_grad_store(WeightGradStore(sink=dp, fuse=fuse))
    fused_calls = []
    if fuse:
        inner, rows = dp.accumulate_product, dp.accumulate_rows
        dp.accumulate_product = lambda p, *ab: (fused_calls.append(p), inner(p, *ab))
        dp.accumulate_rows = lambda p, *ig: (fused_calls.append(("rows", p)), rows(p, *ig))
    for step in range(2):  # the second step proves a step's first product is copied over the last's
        dp.start_step(3)
        for mb in range(3):
            tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(mb))
            model(tokens, labels=tokens.roll(-1, 1)).float().mean().backward()
        dp.finish_grad_sync()
    assert all(p.grad is None for p in model.parameters()), "gradients live in main_grad only"
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}, fused_calls, model


def test_grad_accum_fusion_adds_weight_grads_straight_into_main_grad():
    """With fusion, linear weights' gradients go through accumulate_product and an untied
    embedding's through accumulate_rows (no .grad, no hook); the main gradients equal the unfused
    path's after several micro-batches and steps, for a tied (gpt2: the output layer is the
    embedding, left to autograd) and an untied model. The linear layers' arithmetic is the
    reference's on CPU (equal); the lookup's rows are summed in another order (fp32: within
    rounding), and in fp32 where the reference rounds each micro-batch's to bf16 first."""
    for family, dtype in [("gpt2", torch.float32), ("llama", torch.float32), ("llama", torch.bfloat16)]:
        cfg = ModelConfig(family=family, hidden=32, heads=4, kv_heads=2 if family == "llama" else 0, layers=2,
                          seq_len=8, vocab_size=40, tie_embeddings=family == "gpt2")
        ref, none, _ = _main_grads(cfg, False, dtype)
        got, calls, model = _main_grads(cfg, True, dtype)
        assert none == []
        linears = {m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
        products = [p for p in calls if not isinstance(p, tuple)]
        assert set(products) == linears and len(products) == 2 * 3 * len(linears), "each linear weight, every micro-batch"
        rows = [p for kind, p in (c for c in calls if isinstance(c, tuple))]
        if family == "gpt2":
            assert rows == [] and model.embedding.weight not in set(products), \
                "the tied embedding's two terms are summed by autograd"
        else:
            assert rows == [model.embedding.weight] * 6, "the lookup's rows, every micro-batch"
        for name, grad in ref.items():
            if name == "embedding.weight" and family == "llama":
                atol = grad.abs().max().item() * (2 ** -7 if dtype == torch.bfloat16 else 1e-6)
                torch.testing.assert_close(got[name], grad, rtol=0, atol=atol, msg=name)
            else:
                torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_an_embeddings_rows_add_into_its_main_grad_exactly(grad_dtype):
    """accumulate_rows: three micro-batches of lookups with repeated ids, over two steps, give the
    main gradient the float64 sum of the rows' gradients (the step's first replaces last step's),
    and count one arrival per micro-batch, as the gradient hook would. bf16 main gradients: each
    micro-batch's sum is rounded once and added, as the unfused path's dense gradient is."""
    from tessera.distributed.data_parallel import DataParallel
    from tessera.tensor_parallel.layers import VocabParallelEmbedding
    from tessera.topology import Topology

    emb = VocabParallelEmbedding(16, 8, tp_group=None).to(torch.bfloat16)
    emb.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    dp = DataParallel([emb], Topology.build(), param_dtype=torch.bfloat16, grad_dtype=grad_dtype)
    emb.wgrad_store = WeightGradStore(sink=dp, fuse=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        dp.start_step(3)
        want = torch.zeros(16, 8, dtype=torch.float64)
        rounded = torch.zeros(16, 8, dtype=torch.bfloat16)  # bf16: one rounding per micro-batch
        for mb in range(3):
            ids = torch.randint(0, 5, (4, 6), generator=gen)  # 24 lookups of 5 rows: many repeats
            grad = torch.randn(4, 6, 8, generator=gen).to(torch.bfloat16)
            emb(ids).backward(grad)
            mine = torch.zeros(16, 8, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad.reshape(-1, 8).double())
            want += mine
            rounded = (rounded.float() + mine.float().bfloat16().float()).bfloat16()
        assert emb.weight.grad is None and dp._count[emb.weight] == 3
        dp.finish_grad_sync()
        got = emb.weight.main_grad.view(16, 8)
        assert got.dtype == grad_dtype and not got[5:].any()
        if grad_dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got, rounded, rtol=0, atol=0)


# -- inside compiled layers: the opaque deferrable linear -----------------------------------------
def _llama(store=None):
    cfg = ModelConfig(family="llama", hidden=32, heads=4, kv_heads=2, layers=3, seq_len=8, vocab_size=40)
    model = GPTModel(cfg)
    model.use_weight_grad_store(store)
    model.init_weights(5)
    return model


@pytest.mark.slow
def test_compiled_layers_defer_weight_grads_without_a_graph_break():
    """Layers compiled whole (inductor's CPU backend) with a store whose weights are registered:
    one graph for all three layers and no break (tessera::deferrable_linear and
    linear_input_grad), the weight gradients held back until W and then equal to eager's."""
    import torch._dynamo

    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    eager = _grads(_llama(), tokens)
    store = WeightGradStore()
    model = _llama(store)
    store.register(model.parameters())
    for layer in model.layers.values():
        layer.compile()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = _grads(model, tokens, store)  # asserts the qkv weight's gradient waits for W
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # every layer reuses it
    for name, grad in eager.items():
        torch.testing.assert_close(got[name], grad, msg=name, rtol=1e-5, atol=1e-6)
    # a second step, outside a defer block: the weight gradients come with backward (added)
    model.zero_grad()
    model(tokens, labels=tokens.roll(-1, 1)).mean().backward()
    assert len(store) == 0 and model.layers["0"].attn.qkv.weight.grad is not None
    torch.testing.assert_close(model.layers["0"].attn.qkv.weight.grad, eager["layers.0.attn.qkv.weight"],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_an_unregistered_weight_breaks_the_graph_and_a_lost_store_is_named():
    import torch._dynamo

    from tessera.tensor_parallel import wgrad

    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    store = WeightGradStore()
    model = _llama(store)  # not registered: the eager path between compiled pieces, still right
    for layer in model.layers.values():
        layer.compile()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = _grads(model, tokens, store)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) > 0
    for name, grad in _grads(_llama(), tokens).items():
        torch.testing.assert_close(got[name], grad, msg=name, rtol=1e-5, atol=1e-6)
    weight = model.layers["0"].attn.qkv.weight
    wgrad._register(WeightGradStore(), [weight])  # its store is gone at once: a clear error
    with pytest.raises(RuntimeError, match="not registered with its WeightGradStore"):
        wgrad._registered(weight)


def test_a_nested_defer_gives_the_outer_block_its_key_back():
    store = WeightGradStore()
    with store.defer("outer"):
        with store.defer("inner"):
            assert store.key == "inner"
        assert store.key == "outer"  # (it was None: the outer block's later layers ran undeferred)
    assert store.key is None


@pytest.mark.parametrize("case", ["random", "one id", "masked", "more ids than rows"])
def test_a_lookups_row_sums_name_each_row_about_once_and_add_up_exactly(case):
    """lookup_row_sums: the (row, sum) pairs scatter-added give the float64 sum of the lookup's
    gradient rows, with a long run of one id (padding, or the ids a tp rank masks to row 0) summed
    like any other, and no row named more than n / rows + 1 times (twice where the table has more
    rows than the lookup has ids: the scatter-add has no long chains)."""
    from tessera.tensor_parallel.layers import lookup_row_sums

    gen = torch.Generator().manual_seed(3)
    rows, n = (7, 40) if case == "more ids than rows" else (50, 300)
    ids = torch.randint(0, rows, (n,), generator=gen)
    if case == "one id":
        ids = torch.full((n,), 11)
    elif case == "masked":  # a tp rank's view: most ids outside its range, sent to row 0
        ids = torch.where(torch.rand(n, generator=gen) < 0.8, torch.zeros_like(ids), ids)
    grad = torch.randn(n, 16, generator=gen).to(torch.bfloat16)
    target, sums = lookup_row_sums(ids, grad, rows)
    assert target.shape == (n,) and sums.shape == (n, 16) and sums.dtype == torch.float32
    assert int(torch.bincount(target, minlength=rows).max()) <= (n + rows - 1) // rows + 1
    want = torch.zeros(rows, 16, dtype=torch.float64).index_add_(0, ids, grad.double())
    got = torch.zeros(rows, 16, dtype=torch.float64).index_add_(0, target, sums.double())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
