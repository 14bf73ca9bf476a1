"""Packed sequences: several documents in one sample, kept apart (Megatron's PackedSeqParams and
get_ltor_masks_and_position_ids).

A sample of ``s`` tokens may hold the end of one document, whole documents and the start of
another, separated by end-of-document (EOD) tokens. With ``data.reset_position_ids`` positions
restart at 0 after each EOD; with ``data.reset_attention_mask`` a token attends only to earlier
tokens of its own document; with ``data.eod_mask_loss`` the prediction made at an EOD (whose
target is the next document's first token) gets no loss. An EOD belongs to the document it ends.

Attention over documents runs as variable-length attention (``torch.nn.attention.varlen``, flash
attention over the concatenated documents, no mask in memory) on CUDA when torch has it, and
otherwise as SDPA with a block-diagonal causal mask of ``[b, 1, s, s]`` booleans: the same maths,
the reference path on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.context_parallel import ring_attention

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: the mask path only
    varlen_attn = None


def document_fields(tokens: Tensor, eod: int, *, reset_position_ids: bool, reset_attention_mask: bool,
                    eod_mask_loss: bool) -> dict[str, Tensor]:
    """tokens [b, s] -> the fields a packed micro-batch adds: ``position_ids`` [b, s],
    ``document_ids`` [b, s] (0, 1, ... within each sample) and ``eod_loss_mask`` [b, s] (0 at EODs)."""
    is_eod = tokens == eod
    b, s = tokens.shape
    out = {}
    if reset_attention_mask:
        out["document_ids"] = torch.cumsum(is_eod, dim=1) - is_eod.long()  # EODs strictly before
    if reset_position_ids:
        arange = torch.arange(s, device=tokens.device).expand(b, s)
        starts = torch.zeros_like(is_eod)
        starts[:, 1:] = is_eod[:, :-1]  # a document starts after each EOD
        first = torch.cummax(torch.where(starts, arange, torch.zeros_like(arange)), dim=1).values
        out["position_ids"] = arange - first
    if eod_mask_loss:
        out["eod_loss_mask"] = (~is_eod).float()
    return out


class PackedSequence:
    """Per-micro-batch positions and document layout, shared by every layer of a forward."""

    def __init__(self, position_ids: Tensor | None = None, document_ids: Tensor | None = None, cp_group=None):
        """``cp_group``: the tokens are this rank's chunks of each sample (context parallelism):
        attention runs as ring attention over that group."""
        self.position_ids, self.document_ids, self.cp_group = position_ids, document_ids, cp_group
        self._mask: Tensor | None = None
        self._cu_seqlens: Tensor | None = None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, enable_gqa: bool) -> Tensor:
        """Causal attention, within documents when ``document_ids`` is set. q, k, v: [b, heads, s, d]."""
        if self.cp_group is not None:  # (no dropout with cp: preflight refuses it)
            return ring_attention(q, k, v, self.cp_group, document_ids=self.document_ids)
        if self.document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa)
        if (q.is_cuda and varlen_attn is not None and dropout_p == 0.0 and not enable_gqa
                and q.dtype in (torch.float16, torch.bfloat16)):  # flash attention: 16-bit only
            return self._varlen(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(), dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)

    def mask(self) -> Tensor:
        """[b, 1, s, s]: True where query i may attend key j (j <= i, same document)."""
        if self._mask is None:
            doc = self.document_ids
            s = doc.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
            self._mask = (causal & (doc[:, :, None] == doc[:, None, :])).unsqueeze(1)
        return self._mask

    def cu_seqlens(self) -> Tensor:
        """Offsets of every (sample, document) segment in the flattened [b * s] tokens."""
        if self._cu_seqlens is None:
            doc = self.document_ids
            b, s = doc.shape
            segment = (doc + torch.arange(b, device=doc.device).unsqueeze(1) * s).reshape(-1)
            _, counts = torch.unique_consecutive(segment, return_counts=True)
            self._cu_seqlens = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
        return self._cu_seqlens

    def _varlen(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, h, s, d = q.shape
        flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [b*s, heads, d]
        cu = self.cu_seqlens()
        out = varlen_attn(*flat, cu, cu, s, s, window_size=(-1, 0))  # (-1, 0): causal
        return out.view(b, s, h, d).transpose(1, 2)
