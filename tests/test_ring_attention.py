"""context_parallel: the zigzag layout, the block and merge functions, and ring attention at cp = 1, 2,
4 against causal attention over the whole sequence (within documents too): outputs and the
gradients of q, k, v, MHA and GQA. The flash path runs on CUDA only (the gpu-marked test)."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.context_parallel import positions, ring_attention, unzigzag, zigzag
from tessera.context_parallel import ring as ring_module
from tessera.context_parallel.ring import block_backward, block_forward, block_plan, merge, uses_flash
from tessera.testing import run_ranks
from training_runs import shared_result

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the same sums in another order


@dataclass(frozen=True)
class Case:
    """One attention problem: b = 2 samples of s = 2 * cp * c tokens, head size 8."""

    name: str
    hq: int
    hkv: int
    c: int  # tokens per zigzag chunk
    docs: str | None  # None, "random", "edges" or "one" (see documents())
    seed: int


CASES = [Case("mha", 4, 4, 1, None, 0), Case("gqa", 4, 2, 3, None, 1), Case("mqa", 4, 1, 5, None, 2),
         Case("mha-docs", 4, 4, 3, "random", 3), Case("gqa-docs", 4, 2, 5, "random", 4),
         Case("mqa-doc-edges", 4, 1, 2, "edges", 5), Case("gqa-one-doc", 4, 2, 2, "one", 6)]
BY_NAME = {case.name: case for case in CASES}


def documents(layout: str | None, b: int, s: int, c: int, gen: torch.Generator) -> torch.Tensor | None:
    """[b, s] document ids. random: documents of random lengths (crossing chunk and rank boundaries)
    with a one-token document somewhere; edges: documents of two chunks, starting at chunk
    boundaries, and one-token documents first and last; one: each sample a single document."""
    if layout is None:
        return None
    starts = torch.zeros(b, s, dtype=torch.bool)
    if layout == "random":
        starts[:, 1:] = torch.rand(b, s - 1, generator=gen) < 0.3
        for row in range(b):
            p = int(torch.randint(0, s - 1, (1,), generator=gen))
            starts[row, p] = starts[row, p + 1] = True  # token p alone
    elif layout == "edges":
        starts[:, ::2 * c] = True  # two chunks each: across a rank boundary
        starts[:, [1, s - 1]] = True
    starts[:, 0] = False
    return torch.cumsum(starts.long(), dim=1)


def inputs(case: Case, cp: int):
    """The full-sequence q, k, v, document ids and output weights of ``case`` at ``cp``."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s, d = 2, 2 * cp * case.c, 8
    q = torch.randn(b, case.hq, s, d, generator=gen)
    k, v = (torch.randn(b, case.hkv, s, d, generator=gen) for _ in range(2))
    w = torch.randn(b, case.hq, s, d, generator=gen)  # loss = sum(out * w): a dense dout
    return q, k, v, documents(case.docs, b, s, case.c, gen), w


def full_attention(q, k, v, docs, w):
    """Causal attention over the whole sequence (block-diagonal within documents): out, dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if docs is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=gqa)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def local_ring_attention(case: Case, cp: int, rank: int, group) -> list[torch.Tensor]:
    """This rank's zigzag part of ``case``, through ring_attention: out, dq, dk, dv (local)."""
    q, k, v, docs, w = inputs(case, cp)
    local = [zigzag(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    local_docs = None if docs is None else zigzag(docs, rank, cp, dim=1)
    out = ring_attention(*local, group, document_ids=local_docs)
    (out * zigzag(w, rank, cp, dim=2)).sum().backward()
    return [out.detach(), *(t.grad for t in local)]


def check_against_full(case: Case, cp: int, by_rank: list[list[torch.Tensor]], tol=TOL) -> None:
    expected = full_attention(*inputs(case, cp))
    for i, what in enumerate(["out", "dq", "dk", "dv"]):
        got = unzigzag([parts[i] for parts in by_rank], dim=2)
        torch.testing.assert_close(got, expected[i], **tol, msg=lambda m, what=what: f"{case.name} cp={cp} {what}: {m}")


# -- the zigzag layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_parts_reassemble_and_carry_their_positions(cp):
    x = torch.arange(2 * 4 * cp * 3).view(2, 4 * cp * 3)  # s = 12 * cp
    parts = [zigzag(x, r, cp, dim=1) for r in range(cp)]
    assert torch.equal(unzigzag(parts, dim=1), x)
    c = x.shape[1] // (2 * cp)
    for r, part in enumerate(parts):
        pos = positions(x.shape[1], r, cp)
        assert torch.equal(part, x[:, pos])
        assert pos.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]


def test_zigzag_refuses_a_length_that_does_not_split_into_2cp_chunks():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        zigzag(torch.zeros(6), 0, 2, dim=0)
    with pytest.raises(ValueError, match="cp rank 2"):
        positions(8, 2, 2)


# -- the pure functions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plan_covers_exactly_the_causal_pairs(cp):
    """For every rank and source, the plan's rectangle (causal inside when it says so) is exactly
    the set of (query, key) pairs with key position <= query position: none missed, none extra."""
    c = 3
    s, s_local = 2 * cp * c, 2 * c
    for r in range(cp):
        for j in range(cp):
            qpos, kpos = positions(s, r, cp), positions(s, j, cp)
            needed = kpos[None, :] <= qpos[:, None]
            plan = block_plan(r, j, s_local)
            covered = torch.zeros(s_local, s_local, dtype=torch.bool)
            rect = torch.ones(plan.q.stop - plan.q.start, plan.kv.stop - plan.kv.start, dtype=torch.bool)
            covered[plan.q, plan.kv] = rect.tril() if plan.causal else rect
            assert torch.equal(covered, needed), (r, j, plan)


def test_block_forward_is_attention_with_its_log_sum_exp():
    """The reference block against SDPA with the same mask; rows that see no key: out 0, lse -inf."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for shape in [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)])
    doc_q, doc_k = torch.tensor([[0, 0, 1, 1, 9]] * 2), torch.tensor([[0, 0, 0, 1, 1, 1, 2]] * 2)
    out, lse = block_forward(q, k, v, causal=False, scale=0.3, doc_q=doc_q, doc_k=doc_k)
    mask = (doc_q[:, :, None] == doc_k[:, None, :]).unsqueeze(1)
    ref = F.scaled_dot_product_attention(q[:, :, :4], k, v, attn_mask=mask[:, :, :4], scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out[:, :, :4], ref, **TOL)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TOL)
    assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4])) and torch.isneginf(lse[:, :, 4]).all()


def test_merge_is_softmax_over_the_union_and_keeps_empty_rows_finite():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=gen) for shape in [(1, 2, 6, 8), (1, 2, 10, 8), (1, 2, 10, 8)])
    halves = [block_forward(q, k[:, :, part], v[:, :, part], causal=False, scale=0.25)
              for part in (slice(0, 4), slice(4, 10))]
    out, lse = merge(*halves[0], *halves[1])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.25), **TOL)
    empty = (torch.zeros(1, 2, 6, 8), torch.full((1, 2, 6), float("-inf")))
    out2, lse2 = merge(*empty, *halves[0])
    torch.testing.assert_close(out2, halves[0][0], **TOL)
    out3, lse3 = merge(*empty, *empty)  # neither saw a key
    assert torch.equal(out3, empty[0]) and torch.isneginf(lse3).all()


def simulate_ring(q, k, v, docs, dout, cp):
    """Every cp rank's ring steps in one process through the pure functions (block_plan,
    block_forward, merge, block_backward), no process group: full-sequence out, dq, dk, dv."""
    scale, s_local = q.shape[-1] ** -0.5, q.shape[2] // cp
    qs, ks, vs, dos = ([zigzag(t, r, cp, dim=2) for r in range(cp)] for t in (q, k, v, dout))
    ds = [None if docs is None else zigzag(docs, r, cp, dim=1) for r in range(cp)]

    def doc_rows(r, rows):
        return None if docs is None else ds[r][:, rows]
    outs, lses = [], []
    for r in range(cp):
        out = torch.zeros(qs[r].shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qs[r].shape[:3], float("-inf"), device=q.device)
        for i in range(cp):
            j = (r - i) % cp
            p = block_plan(r, j, s_local)
            block = block_forward(qs[r][:, :, p.q], ks[j][:, :, p.kv], vs[j][:, :, p.kv], causal=p.causal,
                                  scale=scale, doc_q=doc_rows(r, p.q), doc_k=doc_rows(j, p.kv))
            out[:, :, p.q], lse[:, :, p.q] = merge(out[:, :, p.q], lse[:, :, p.q], *block)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    dqs, dks, dvs = ([torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ts] for ts in (qs, ks, vs))
    for r in range(cp):
        for i in range(cp):
            j = (r - i) % cp
            p = block_plan(r, j, s_local)
            dq, dk, dv = block_backward(dos[r][:, :, p.q], qs[r][:, :, p.q], ks[j][:, :, p.kv], vs[j][:, :, p.kv],
                                        outs[r][:, :, p.q], lses[r][:, :, p.q], causal=p.causal, scale=scale,
                                        doc_q=doc_rows(r, p.q), doc_k=doc_rows(j, p.kv))
            dqs[r][:, :, p.q] += dq
            dks[j][:, :, p.kv] += dk
            dvs[j][:, :, p.kv] += dv
    return [unzigzag(parts, dim=2) for parts in (outs, dqs, dks, dvs)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_blocks_and_merge_match_full_attention_in_one_process(name, cp):
    q, k, v, docs, w = inputs(BY_NAME[name], cp)
    got, expected = simulate_ring(q, k, v, docs, w, cp), full_attention(q, k, v, docs, w)
    for what, a, b in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, what=what: f"{name} cp={cp} {what}: {m}")


def test_flash_calls_fit_the_aten_schemas():
    """The flash path's calls (GQA heads expanded, their gradients summed back) on the meta device:
    the argument lists and shapes, which only a GPU could otherwise check."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 8, 16, 64, **meta), torch.empty(2, 2, 32, 64, **meta)
    out, lse = ring_module._flash_forward(q, k, k, False, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, 16) and lse.dtype == torch.float32
    dq, dk, dv = ring_module._flash_backward(out, q, k, k, out, lse, False, 0.125)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dk.dtype == torch.float32
    assert not uses_flash(q) and not uses_flash(q.float())  # meta is not CUDA


# -- ring attention, one process -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_without_a_group_it_is_causal_attention(name):
    check_against_full(BY_NAME[name], 1, [local_ring_attention(BY_NAME[name], 1, 0, None)])


def test_ring_attention_refuses_shapes_it_cannot_attend():
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 3, 6, 8)
    with pytest.raises(ValueError, match="multiple of the K/V heads"):
        ring_attention(q, k, k, None)
    with pytest.raises(ValueError, match="document_ids"):
        ring_attention(q, q, q, None, document_ids=torch.zeros(1, 5, dtype=torch.long))


# -- ring attention over gloo ranks -------------------------------------------------------------------------------
def _cases_worker(rank, world, cases):
    return {case.name: local_ring_attention(case, world, rank, dist.group.WORLD) for case in cases}


_RESULTS: dict = {}


def ring_results(cp: int) -> list[dict]:
    """One run_ranks call per cp, every case in it, shared by the tests that read it."""
    return shared_result(_RESULTS, cp, lambda: run_ranks(_cases_worker, cp, CASES, timeout=120))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", [c.name for c in CASES])
@pytest.mark.parametrize("cp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # (4 ranks: the whole suite)
def test_ring_attention_matches_full_attention(cp, name):
    check_against_full(BY_NAME[name], cp, [r[name] for r in ring_results(cp)])


def _subgroups_worker(rank, world):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, in order
    group = groups[rank % 2]
    case = [BY_NAME["gqa-docs"], BY_NAME["mqa"]][rank % 2]
    return local_ring_attention(case, 2, dist.get_rank(group), group)


@pytest.mark.timeout(150)
def test_cp_groups_inside_a_larger_world_exchange_with_their_own_members():
    """Two cp groups of 2 in a world of 4 ({0, 2} and {1, 3}): the ring's peers are global ranks."""
    by_rank = run_ranks(_subgroups_worker, 4, timeout=120)
    check_against_full(BY_NAME["gqa-docs"], 2, [by_rank[0], by_rank[2]])
    check_against_full(BY_NAME["mqa"], 2, [by_rank[1], by_rank[3]])


def _order_worker(rank, world):
    """ring_attention forward and backward with the exchanges and block computations recorded in order."""
    events, post = [], dist.batch_isend_irecv

    class Waited:  # a posted operation that notes when it is waited for
        def __init__(self, work, tags):
            self.work, self.tags = work, tags

        def wait(self):
            events.append(("wait", self.tags))
            return self.work.wait()

    def recorded_post(ops):
        tags = tuple(sorted({op.tag for op in ops}))
        events.append(("post", tags))
        return [Waited(work, tags) for work in post(ops)]

    def recorded(name, fn):
        def call(*args, **kwargs):
            events.append((name,))
            return fn(*args, **kwargs)
        return call

    case = BY_NAME["gqa-docs"]
    with mock.patch.object(dist, "batch_isend_irecv", recorded_post), \
            mock.patch.object(ring_module, "block_forward", recorded("block", ring_module.block_forward)), \
            mock.patch.object(ring_module, "block_backward", recorded("block", ring_module.block_backward)):
        q, k, v, docs, _ = inputs(case, world)
        local = [zigzag(t, rank, world, dim=2).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, dist.group.WORLD, document_ids=zigzag(docs, rank, world, dim=1))
        forward = list(events)
        events.clear()
        out.sum().backward()
    dedup = lambda es: [e for i, e in enumerate(es) if i == 0 or e != es[i - 1]]  # one wait per work
    return dedup(forward), dedup(events)


@pytest.mark.timeout(90)
def test_each_exchange_is_posted_before_the_block_in_hand_is_computed():
    """At every step the next K/V block (with its document ids) is on its way while this block is
    computed, and in backward the dk/dv accumulator travels the same way, one step behind."""
    cp = 3
    kv, grads = ("post", (ring_module.KV_TAG, ring_module.DOC_TAG)), ("post", (ring_module.GRAD_TAG,))
    forward, backward = [], []
    for i in range(cp):
        last = i == cp - 1
        forward += ([] if last else [kv]) + [("block",)] + ([] if last else [("wait", kv[1])])
        backward += (([] if last else [kv]) + [("block",)] + ([] if i == 0 else [("wait", grads[1])])
                     + [grads] + ([] if last else [("wait", kv[1])]))
    backward.append(("wait", grads[1]))  # our own block's dk, dv, back after cp steps
    for rank_forward, rank_backward in run_ranks(_order_worker, cp, timeout=60):
        assert rank_forward == forward
        assert rank_backward == backward


# -- the flash path -----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("with_docs", [False, True])
def test_blocks_in_bf16_on_cuda_match_full_flash_attention(hkv, with_docs):
    """Four ranks' ring steps simulated with the pure functions in bf16 on CUDA (the flash
    kernels without documents, the reference blocks with them) against full attention in bf16
    (flash; SDPA with the document mask): outputs and gradients within bf16 rounding."""
    cp, b, hq, s, d = 4, 2, 8, 2048, 64
    gen = torch.Generator("cuda").manual_seed(0)
    q, dout = (torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    docs = None
    if with_docs:
        starts = torch.rand(b, s, device="cuda", generator=gen) < 4 / 1024
        starts[:, 0] = False
        docs = torch.cumsum(starts.long(), dim=1)
    assert uses_flash(q, docs) != with_docs
    got = simulate_ring(q, k, v, docs, dout, cp)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    full_q, full_k, full_v = leaves[0], *(t.repeat_interleave(hq // hkv, dim=1) for t in leaves[1:])  # flash: no GQA
    if docs is None:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(full_q, full_k, full_v, is_causal=True)
    else:
        mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril() & (docs[:, :, None] == docs[:, None, :])
        out = F.scaled_dot_product_attention(full_q, full_k, full_v, attn_mask=mask.unsqueeze(1))
    out.backward(dout)
    expected = [out.detach()] + [t.grad for t in leaves]
    for what, a, ref in zip(["out", "dq", "dk", "dv"], got, expected):
        error = (a.float() - ref.float()).norm() / ref.float().norm()
        assert error < 1e-2, f"{what}: relative error {error:.2e}"
