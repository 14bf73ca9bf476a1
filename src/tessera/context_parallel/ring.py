"""Ring attention: causal attention over a sample whose sequence is split over the cp ranks.

Each cp rank holds two zigzag chunks (chunks.py) of q, k and v: ``c`` tokens of chunk r and ``c``
of chunk 2cp-1-r, ``s_local = 2c``. Its queries must see the keys of every rank, so the K/V
blocks travel around the ring (send to r+1, receive from r-1) while each rank attends to the
block in hand. Plan of the forward, on cp rank r:

1. step i = 0 .. cp-1 holds the K/V (and, with documents, the document ids) of cp rank
   j = (r - i) mod cp; only the K/V heads travel (GQA expands them locally);
2. before computing step i, post the exchange of the block in hand (``batch_isend_irecv``, to
   r+1, from r-1), so the transfer of step i+1's block overlaps step i's compute;
3. which part of the block pair is needed follows from the chunk indices (:func:`block_plan`):
   j = r is causal attention over the local concatenation (its chunks are in sample order);
   j < r: every local query sees the block's first chunk fully, its second chunk not at all;
   j > r: only the local second chunk's queries attend, to the whole block; with documents,
   pairs of different documents are masked as well;
4. each block gives (out, lse), lse the rows' log-sum-exp in fp32; blocks merge by their lse
   (flash attention's online softmax, :func:`merge`), a row with no visible key yet weighing 0.

The backward runs the ring again with the merged out and lse saved by the forward:

5. for the block of rank j in hand, compute dq (accumulated here, fp32) and the block's dk, dv;
6. dk, dv join an fp32 accumulator for rank j's block that travels with it: received from r-1
   (posted at the previous step, so it overlaps this step's compute), added to, sent to r+1;
   after cp steps each accumulator arrives back at its owner.

A block is computed by one of two implementations with the same semantics: the reference path
of plain torch ops (fp32 maths: CPU, fp32 inputs, and whenever document ids are given), and on
CUDA, for 16-bit inputs without documents, the flash attention kernels that return the lse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None
KV_TAG, DOC_TAG, GRAD_TAG = 0, 1, 2  # one message stream each, so they can never be mismatched

aten = torch.ops.aten


# -- which part of a block pair is needed ----------------------------------------------------------
@dataclass(frozen=True)
class BlockPlan:
    """The local query rows ``q`` that attend to the key rows ``kv`` of the block in hand, and
    whether the causal mask applies between them (only to the rank's own block)."""

    q: slice
    kv: slice
    causal: bool


def block_plan(cp_rank: int, source: int, s_local: int) -> BlockPlan:
    """The attention this rank's queries owe the K/V block of cp rank ``source`` (step 3 of the plan)."""
    c, everything = s_local // 2, slice(0, s_local)
    if source == cp_rank:
        return BlockPlan(everything, everything, True)
    if source < cp_rank:  # the block's first chunk is earlier than both of ours, its second later
        return BlockPlan(everything, slice(0, c), False)
    return BlockPlan(slice(c, s_local), everything, False)  # both of its chunks precede our second


# -- one block: (out, lse) and its backward ---------------------------------------------------------
def uses_flash(q: Tensor, doc_q: Tensor | None = None) -> bool:
    """Whether a block goes through the flash kernels: CUDA, 16-bit, no documents, a supported head size."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and doc_q is None
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def block_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                  doc_q: Tensor | None = None, doc_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q [b, hq, m, d] to k, v [b, hkv, n, d] -> (out [b, hq, m, d], lse [b, hq, m] fp32).
    ``causal``: query i sees key j <= i (m == n); doc_q [b, m], doc_k [b, n]: only equal ids see
    each other. A row that sees no key has out 0 and lse -inf."""
    if uses_flash(q, doc_q):
        return _flash_forward(q, k, v, causal, scale)
    return _reference_forward(q, k, v, causal, scale, doc_q, doc_k)


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                   causal: bool, scale: float, doc_q: Tensor | None = None,
                   doc_k: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of dq, dk, dv (fp32), given the rows' *merged* out and lse: with the
    final softmax normaliser each block's gradient is its exact part of the whole one."""
    if uses_flash(q, doc_q):
        return _flash_backward(dout, q, k, v, out, lse, causal, scale)
    return _reference_backward(dout, q, k, v, out, lse, causal, scale, doc_q, doc_k)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the union of two key sets from the attention over each: out [.., m, d] (fp32),
    lse [.., m]. Rows where neither saw a key keep out 0, lse -inf (no NaN)."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isneginf(new), 0.0)  # exp(-inf - 0) = 0 rather than exp(nan)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


def _mask(m: int, n: int, causal: bool, doc_q: Tensor | None, doc_k: Tensor | None, device) -> Tensor | None:
    """[b or 1, 1, 1, m, n] (grouped heads' layout): True where a query may attend a key."""
    mask = torch.ones(m, n, dtype=torch.bool, device=device).tril() if causal else None
    if doc_q is not None:
        same = (doc_q[:, :, None] == doc_k[:, None, :])  # [b, m, n]
        mask = same if mask is None else same & mask
    return None if mask is None else mask.view(-1, 1, 1, m, n)


def _grouped(q: Tensor, hkv: int) -> Tensor:
    """[b, hq, m, d] -> [b, hkv, g, m, d]: query head h uses K/V head h // g (SDPA's enable_gqa)."""
    b, hq, m, d = q.shape
    return q.float().view(b, hkv, hq // hkv, m, d)


def _scores(q: Tensor, k: Tensor, causal, scale, doc_q, doc_k) -> Tensor:
    """Scaled scores [b, hkv, g, m, n] in fp32, -inf where masked."""
    s = (_grouped(q, k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
    mask = _mask(q.shape[2], k.shape[2], causal, doc_q, doc_k, q.device)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _probabilities(s: Tensor, lse: Tensor) -> Tensor:
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))  # masked: exp(-inf) = 0


def _reference_forward(q, k, v, causal, scale, doc_q, doc_k):
    b, hq, m, d = q.shape
    s = _scores(q, k, causal, scale, doc_q, doc_k)
    lse = torch.logsumexp(s, dim=-1)  # [b, hkv, g, m]; -inf for a row that sees nothing
    out = _probabilities(s, lse) @ v.float().unsqueeze(2)
    return out.reshape(b, hq, m, v.shape[-1]), lse.reshape(b, hq, m)


def _reference_backward(dout, q, k, v, out, lse, causal, scale, doc_q, doc_k):
    """P = exp(S - lse), D = rowsum(dO * O), dS = P * (dP - D); K/V gradients summed over each group."""
    b, hq, m, _ = q.shape
    hkv = k.shape[1]
    p = _probabilities(_scores(q, k, causal, scale, doc_q, doc_k), lse.float().view(b, hkv, hq // hkv, m))
    do, o = _grouped(dout, hkv), _grouped(out, hkv)
    dv = (p.transpose(-1, -2) @ do).sum(2)
    dp = do @ v.float().unsqueeze(2).transpose(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = (ds @ k.float().unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ _grouped(q, hkv)).sum(2) * scale
    return dq.reshape(q.shape), dk, dv


def _expand(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _flash_forward(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    q, k, v = q.contiguous(), _expand(k, g).contiguous(), _expand(v, g).contiguous()
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    b, hkv, n, d = k.shape
    g = q.shape[1] // hkv
    unused = torch.zeros(2, dtype=torch.long, device=q.device)  # the dropout RNG state: read only with dropout
    q, k, v, out, dout = (t.contiguous() for t in (q, _expand(k, g), _expand(v, g), out, dout))
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], n, 0.0, causal, unused, unused, scale=scale)
    dk, dv = (t.float().view(b, hkv, g, n, d).sum(2) for t in (dk, dv))  # GQA: back to the K/V heads
    return dq.float(), dk, dv


# -- the ring --------------------------------------------------------------------------------------
class _Pending:
    """Posted sends and receives; :meth:`wait` returns the received tensors."""

    def __init__(self, works, sent: list[Tensor], received: list[Tensor]):
        self.works, self.sent, self.received = works, sent, received  # sent: alive until done

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.received


class _Ring:
    """This rank's place in the cp ring and the exchange with its neighbours (to r+1, from r-1)."""

    def __init__(self, group: Group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:  # P2POp takes global ranks
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def post(self, tensors: list[Tensor], tags: list[int]) -> _Pending:
        """Send ``tensors`` to the next rank and receive the same shapes from the previous one."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t, tag in zip(tensors, tags)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t, tag in zip(received, tags)]
        return _Pending(dist.batch_isend_irecv(ops), tensors, received)

    def post_block(self, kv: Tensor, docs: Tensor | None) -> _Pending:
        """The K/V block in hand (and its document ids) onwards."""
        return self.post([kv] if docs is None else [kv, docs], [KV_TAG] if docs is None else [KV_TAG, DOC_TAG])


def _rows(t: Tensor | None, rows: slice, dim: int = 2) -> Tensor | None:
    return None if t is None else t.narrow(dim, rows.start, rows.stop - rows.start)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, docs: Tensor | None, ring: _Ring,
                  scale: float) -> tuple[Tensor, Tensor]:
    """Steps 1-4 of the plan: the merged out [b, hq, s_local, d] and lse [b, hq, s_local], fp32."""
    b, hq, s_local, d = q.shape
    out = q.new_zeros(b, hq, s_local, v.shape[-1], dtype=torch.float32)
    lse = q.new_full((b, hq, s_local), float("-inf"), dtype=torch.float32)
    kv, kv_docs = torch.stack([k, v]), docs  # [2, b, hkv, s_local, d]: one message
    for i in range(ring.size):
        pending = ring.post_block(kv, kv_docs) if i < ring.size - 1 else None  # before the compute
        plan = block_plan(ring.rank, (ring.rank - i) % ring.size, s_local)
        block_out, block_lse = block_forward(
            _rows(q, plan.q), _rows(kv[0], plan.kv), _rows(kv[1], plan.kv), causal=plan.causal, scale=scale,
            doc_q=_rows(docs, plan.q, 1), doc_k=_rows(kv_docs, plan.kv, 1))
        out_rows, lse_rows = _rows(out, plan.q), _rows(lse, plan.q)
        merged_out, merged_lse = merge(out_rows, lse_rows, block_out, block_lse)
        out_rows.copy_(merged_out)
        lse_rows.copy_(merged_lse)
        if pending is not None:
            kv, *rest = pending.wait()
            kv_docs = rest[0] if rest else None
    return out, lse


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   docs: Tensor | None, ring: _Ring, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 5-6 of the plan: dq, dk, dv in fp32."""
    s_local = q.shape[2]
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv, kv_docs = torch.stack([k, v]), docs
    grads: _Pending | None = None  # the accumulator of the block in hand, on its way from r-1
    for i in range(ring.size):
        pending = ring.post_block(kv, kv_docs) if i < ring.size - 1 else None  # before the compute
        plan = block_plan(ring.rank, (ring.rank - i) % ring.size, s_local)
        block_dq, block_dk, block_dv = block_backward(
            _rows(dout, plan.q), _rows(q, plan.q), _rows(kv[0], plan.kv), _rows(kv[1], plan.kv),
            _rows(out, plan.q), _rows(lse, plan.q), causal=plan.causal, scale=scale,
            doc_q=_rows(docs, plan.q, 1), doc_k=_rows(kv_docs, plan.kv, 1))
        _rows(dq, plan.q).add_(block_dq)
        dkv = grads.wait()[0] if grads is not None else torch.zeros_like(kv, dtype=torch.float32)
        _rows(dkv[0], plan.kv).add_(block_dk)
        _rows(dkv[1], plan.kv).add_(block_dv)
        if ring.size > 1:  # onwards with its block; the accumulator of our next block comes in
            grads = ring.post([dkv], [GRAD_TAG])
        if pending is not None:
            kv, *rest = pending.wait()
            kv_docs = rest[0] if rest else None
    if grads is not None:  # after cp steps, our own block's accumulator is back
        dkv = grads.wait()[0]
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, document_ids, group, scale):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, document_ids, ring, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, docs, ctx.ring, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Group, *, document_ids: Tensor | None = None,
                   scale: float | None = None) -> Tensor:
    """q [b, hq, s_local, d], k and v [b, hkv, s_local, d] (hq a multiple of hkv: GQA): this cp rank's
    two zigzag chunks. Causal attention over the whole sample, within documents where document_ids
    [b, s_local] (this rank's tokens' document ids, ids comparable across the sample) is given.
    group: the cp process group (None or size 1: ordinary causal attention). Returns [b, hq, s_local, d]."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q, k, v must be [b, heads, s_local, d]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, hq, s_local, d = q.shape
    if k.shape[0] != b or k.shape[2] != s_local or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"k and v {tuple(k.shape)} do not fit q {tuple(q.shape)}: same batch, length and head "
                         "size, and the query heads a multiple of the K/V heads")
    cp = 1 if group is None else dist.get_world_size(group)
    if cp > 1 and s_local % 2:
        raise ValueError(f"local length {s_local} is odd: each cp rank holds two equal zigzag chunks")
    if document_ids is not None and document_ids.shape != (b, s_local):
        raise ValueError(f"document_ids {tuple(document_ids.shape)} must be [b, s_local] = {(b, s_local)}")
    scale = d ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, document_ids, group, scale)
