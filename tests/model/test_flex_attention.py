"""Document masks through FlexAttention compute what the dense-mask SDPA path computes:
the same pairs allowed, the same outputs and gradients (fp32, CPU), grouped-query attention
included.

PyTorch refuses FlexAttention's backward on CPUs, but its eager path there is a reference
implementation of the same math in plain tensor operations, backward included; the
`reference_backward` fixture lifts that refusal, so the gradients of ember's mask function
and plumbing are compared with the dense mask's. On CUDA the compiled kernel computes them."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from ember.config import ConfigError, ModelConfig, load_config
from ember.model import Transformer
from ember.model.layers import attention_mask
from test_gqa import gqa_gradients, grouped_and_repeated, outputs_and_gradients, tiny

SEQ = 150  # more than one 128-token block, and not a multiple of it


def documents(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    """Rows of several documents of uneven lengths, one row a single document."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for start in (7, 40, 41, 133):
        ids[0, start:] += 1
    ids[1] = 0
    return ids


def padding(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    real = torch.ones(batch, seq, dtype=torch.bool)
    real[1, seq - 20:] = False
    return real


@pytest.mark.parametrize("causal,padded", [(True, False), (False, False), (False, True), (True, True)])
def test_the_block_mask_allows_the_pairs_the_dense_mask_allows(causal, padded):
    docs, real = documents(), padding() if padded else None
    dense = attention_mask(causal, real, docs)
    block = attention_mask(causal, real, docs, flex=True)
    assert isinstance(block, BlockMask)
    allowed = create_mask(block.mask_mod, docs.shape[0], 1, SEQ, SEQ, device="cpu")
    assert torch.equal(allowed, dense.expand_as(allowed))


@pytest.fixture
def reference_backward(monkeypatch):
    import torch.nn.attention.flex_attention as flex_module

    check = flex_module._validate_device

    def allow_cpu_backward(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    monkeypatch.setattr(flex_module, "_validate_device", allow_cpu_backward)


def model(objective: str, kernel: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(objective=objective, vocab_size=97, hidden=32, layers=2, heads=4, mlp_hidden=64,
                      max_seq_len=SEQ, positions="rotary", document_kernel=kernel, **overrides)
    return Transformer(cfg)


def loss_and_grads(net: Transformer, ids, labels, docs):
    loss = net(ids, labels, reduction="sum", document_ids=docs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters()}


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_loss_and_gradients_equal_the_dense_mask(objective, reference_backward):
    torch.manual_seed(1)
    ids, docs = torch.randint(5, 97, (2, SEQ)), documents()
    labels = torch.roll(ids, -1, dims=1) if objective == "causal" else torch.where(torch.rand(2, SEQ) < 0.3, ids, -100)
    want, want_grads = loss_and_grads(model(objective, "sdpa"), ids, labels, docs)
    got, got_grads = loss_and_grads(model(objective, "flex"), ids, labels, docs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_padding_and_documents_equal_the_dense_mask_for_a_masked_lm(reference_backward):
    torch.manual_seed(2)
    ids, docs, real = torch.randint(5, 97, (2, SEQ)), documents(), padding()
    hidden = {}
    for kernel in ("sdpa", "flex"):
        net = model("mlm", kernel)
        out = net.trunk(ids, key_padding_mask=real, document_ids=docs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        hidden[kernel] = out.detach(), net.embed.weight.grad.clone()
    torch.testing.assert_close(hidden["flex"][0], hidden["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden["flex"][1], hidden["sdpa"][1], rtol=1e-4, atol=1e-5)


def test_auto_takes_flex_on_cuda_only_and_never_with_dropout():
    net = model("causal", "auto")
    assert net._flex(torch.device("cuda")) and not net._flex(torch.device("cpu"))
    assert not model("causal", "auto", dropout=0.1)._flex(torch.device("cuda"))
    assert model("causal", "flex")._flex(torch.device("cpu")) and not model("causal", "sdpa")._flex(
        torch.device("cuda"))


def test_flex_with_dropout_is_refused():
    with pytest.raises(ConfigError, match="document_kernel=flex has no attention dropout"):
        load_config(None, ["model.dropout=0.1", "model.document_kernel=flex"])
    with pytest.raises(ConfigError, match="model.document_kernel must be one of"):
        load_config(None, ["model.document_kernel=varlen"])


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_grouped_query_attention_equals_repeated_heads(objective, reference_backward):
    gqa, mha = grouped_and_repeated(tiny(objective=objective, max_seq_len=SEQ, document_kernel="flex"))
    ids, docs = torch.randint(5, 97, (2, SEQ), generator=torch.Generator().manual_seed(3)), documents()
    masks = {"document_ids": docs, "key_padding_mask": padding() if objective == "mlm" else None}
    got, want = outputs_and_gradients(gqa, ids, **masks), outputs_and_gradients(mha, ids, **masks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want_grads = gqa_gradients(mha)
    for name, p in gqa.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
