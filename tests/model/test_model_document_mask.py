"""Attention inside documents: a document packed after another is computed as if alone."""

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer
from ember.model.layers import attention_mask

FIRST, SECOND = 5, 7  # document lengths in the packed row


def build(objective: str, positions: str = "rotary", **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(objective=objective, vocab_size=100, hidden=32, layers=2, heads=2, mlp_hidden=64,
                      max_seq_len=16, positions=positions, **overrides)
    return Transformer(cfg).eval()


def packed() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (1, FIRST + SECOND))
    docs = torch.tensor([[0] * FIRST + [1] * SECOND])
    return ids, docs


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_second_document_sees_only_itself(objective):
    # Rotary attention depends only on distances, so with the mask the second document's
    # hidden states equal those of the document run alone; without it they do not.
    model = build(objective)
    ids, docs = packed()
    with torch.no_grad():
        alone = model.trunk(ids[:, FIRST:])
        masked = model.trunk(ids, document_ids=docs)[:, FIRST:]
        unmasked = model.trunk(ids)[:, FIRST:]
        first_alone = model.trunk(ids[:, :FIRST])
        first_masked = model.trunk(ids, document_ids=docs)[:, :FIRST]
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first_masked, first_alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3)


@pytest.mark.parametrize("objective,sparse", [("causal", False), ("mlm", True), ("mlm", False)])
def test_loss_of_the_second_document_equals_its_loss_alone(objective, sparse):
    model = build(objective, sparse_prediction=sparse)
    ids, docs = packed()
    labels = torch.full_like(ids, -100)
    if objective == "causal":
        labels[:, FIRST:-1] = ids[:, FIRST + 1:]
    else:
        labels[:, FIRST + 1::2] = ids[:, FIRST + 1::2]
    with torch.no_grad():
        alone = model(ids[:, FIRST:], labels[:, FIRST:], reduction="sum")
        masked = model(ids, labels, reduction="sum", document_ids=docs)
        unmasked = model(ids, labels, reduction="sum")
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    assert abs(float(unmasked) - float(alone)) > 1e-3


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_absolute_positions_still_keep_documents_apart(objective):
    # Learned positions count from the row's start, so compare two rows whose first
    # documents differ: the second document cannot tell them apart.
    model = build(objective, positions="learned")
    ids, docs = packed()
    other = ids.clone()
    other[:, :FIRST] = (other[:, :FIRST] + 7) % 95 + 5
    with torch.no_grad():
        a = model.trunk(ids, document_ids=docs)[:, FIRST:]
        b = model.trunk(other, document_ids=docs)[:, FIRST:]
        c = model.trunk(other)[:, FIRST:]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c, atol=1e-3)


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_one_document_per_row_equals_no_mask(objective):
    model = build(objective)
    ids, _ = packed()
    with torch.no_grad():
        torch.testing.assert_close(model.trunk(ids, document_ids=torch.zeros_like(ids)), model.trunk(ids),
                                   rtol=1e-5, atol=1e-5)


def test_padding_and_documents_combine_for_a_masked_lm():
    model = build("mlm")
    ids, docs = packed()
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    padded_docs = torch.cat([docs, torch.full((1, 4), 2)], dim=1)
    real = torch.arange(padded.shape[1])[None, :] < ids.shape[1]
    with torch.no_grad():
        both = model.trunk(padded, key_padding_mask=real, document_ids=padded_docs)
        alone = model.trunk(ids[:, FIRST:])
    assert torch.isfinite(both).all()  # pad queries attend to themselves, never to nothing
    torch.testing.assert_close(both[:, FIRST:ids.shape[1]], alone, rtol=1e-5, atol=1e-5)


def test_the_mask_itself():
    assert attention_mask(True) is None and attention_mask(False) is None  # SDPA's fast paths
    real = torch.tensor([[True, True, False]])
    assert attention_mask(True, real) is None  # causal queries never reach later pads
    assert attention_mask(False, real).tolist() == [[[[True, True, False]]]]
    docs = torch.tensor([[0, 0, 1]])
    assert attention_mask(True, None, docs)[0, 0].tolist() == [[True, False, False],
                                                               [True, True, False],
                                                               [False, False, True]]
    assert attention_mask(False, None, docs)[0, 0].tolist() == [[True, True, False],
                                                                [True, True, False],
                                                                [False, False, True]]
    assert attention_mask(False, torch.tensor([[True, False, False]]), torch.zeros(1, 3))[0, 0].tolist() == [
        [True, False, False], [True, True, False], [True, False, True]]
