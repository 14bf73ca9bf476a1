"""Packed sequences: a sample holding several documents behaves like the documents run apart."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models import GPTModel
from tessera.models.packed import PackedSequence, document_fields

EOD = 0


def test_document_fields_by_hand():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, 8, 9, 9]])
    f = document_fields(tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert f["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]  # an EOD belongs to the document it ends
    assert f["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert f["eod_loss_mask"].tolist() == [[1, 1, 0, 1, 0, 1, 1, 1]]
    none = document_fields(tokens, EOD, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    assert none == {}


def test_mask_is_block_diagonal_causal():
    seq = PackedSequence(document_ids=torch.tensor([[0, 0, 1, 1, 1]]))
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(seq.mask()[0, 0], expected.bool())
    assert seq.cu_seqlens().tolist() == [0, 2, 5]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_loss_equals_documents_run_apart(family):
    kw = dict(kv_heads=2, tie_embeddings=False) if family == "llama" else {}
    cfg = ModelConfig(family=family, hidden=32, layers=2, heads=4, seq_len=16, vocab_size=40, **kw)
    model = GPTModel(cfg)
    model.init_weights(3)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 40, (n,), generator=g) for n in (4, 5, 6)]
    stream = torch.cat([torch.cat([d, torch.tensor([EOD])]) for d in docs])  # 18 tokens
    tokens, labels = stream[:15].unsqueeze(0), stream[1:16].unsqueeze(0)  # the sample cuts the last document
    fields = document_fields(tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False)
    packed = model(tokens, labels=labels, position_ids=fields["position_ids"], document_ids=fields["document_ids"])
    apart, start = [], 0
    for n in (5, 6, 4):  # each document with its EOD; the last one cut by the sample's end
        apart.append(model(tokens[:, start:start + n], labels=labels[:, start:start + n]))
        start += n
    torch.testing.assert_close(packed, torch.cat(apart, dim=1), rtol=1e-5, atol=1e-5)
    assert packed.sum().item() == pytest.approx(sum(a.sum().item() for a in apart), rel=1e-5)
    unpacked = model(tokens, labels=labels)  # and the packing did change something
    assert not torch.allclose(unpacked, packed)
