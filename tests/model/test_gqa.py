"""Grouped-query attention (model.kv_heads): a model computes what multi-head attention
computes with each key/value head repeated for the query heads of its group (the same
outputs, and gradients that are the repeated model's summed over each group) on every
attention path; the smaller k/v projections reach the parameter and FLOP counts."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
from ember.cost import matmul_params, model_flops_per_token
from ember.model import Transformer
from ember.plan.memory import total_params
from ember.plan.models import from_config

HEADS, KV_HEADS = 4, 2
GROUP = HEADS // KV_HEADS
SEQ = 40


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden=32, layers=2, heads=HEADS, kv_heads=KV_HEADS, mlp_hidden=64, max_seq_len=SEQ,
                positions="rotary", activation="swiglu", norm="rmsnorm")
    return ModelConfig(**{**base, **overrides})


def _grouped(name: str) -> bool:
    return ".k_proj." in name or ".v_proj." in name


def grouped_and_repeated(cfg: ModelConfig) -> tuple[Transformer, Transformer]:
    """A GQA model and the multi-head model whose k/v projections hold its key/value heads,
    each repeated for the GROUP query heads that read it (head i reads i // GROUP)."""
    torch.manual_seed(0)
    gqa = Transformer(cfg)
    mha = Transformer(dataclasses.replace(cfg, kv_heads=0))
    state = {name: t.unflatten(0, (KV_HEADS, -1)).repeat_interleave(GROUP, dim=0).flatten(0, 1) if _grouped(name)
             else t for name, t in gqa.state_dict().items()}
    mha.load_state_dict(state)
    return gqa, mha


def gqa_gradients(mha: Transformer) -> dict[str, torch.Tensor]:
    """The repeated model's gradients in the GQA model's shapes: a shared head's gradient is
    the sum over the query heads that read it."""
    return {name: p.grad.unflatten(0, (KV_HEADS, GROUP, -1)).sum(1).flatten(0, 1) if _grouped(name) else p.grad
            for name, p in mha.named_parameters()}


def outputs_and_gradients(net: Transformer, ids, **masks):
    out = net.trunk(ids, **masks)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def documents(batch: int = 2) -> torch.Tensor:
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    for start in (5, 17, 18, 30):
        ids[0, start:] += 1
    return ids


def padding(batch: int = 2) -> torch.Tensor:
    real = torch.ones(batch, SEQ, dtype=torch.bool)
    real[1, SEQ - 11:] = False
    return real


# (objective, masks): causal and unmasked MLM take SDPA's enable_gqa; a padding or document
# mask takes the dense mask and repeated k/v.
CASES = {
    "causal": ("causal", {}),
    "mlm": ("mlm", {}),
    "mlm-padding": ("mlm", {"key_padding_mask": padding()}),
    "causal-documents": ("causal", {"document_ids": documents()}),
    "mlm-documents-padding": ("mlm", {"document_ids": documents(), "key_padding_mask": padding()}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_attention_equals_multi_head_attention_with_repeated_heads(case, bias):
    objective, masks = CASES[case]
    gqa, mha = grouped_and_repeated(tiny(objective=objective, bias=bias, document_kernel="sdpa"))
    assert gqa.blocks["0"].attn.k_proj.weight.shape == (KV_HEADS * 8, 32)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    got, want = outputs_and_gradients(gqa, ids, **masks), outputs_and_gradients(mha, ids, **masks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want_grads = gqa_gradients(mha)
    for name, p in gqa.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_training_loss_equals_the_repeated_models():
    gqa, mha = grouped_and_repeated(tiny(objective="causal", dropout=0.0))
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, dims=1)
    torch.testing.assert_close(gqa(ids, labels), mha(ids, labels), rtol=1e-5, atol=1e-6)


def test_parameter_count_and_flops_have_the_smaller_kv_projections():
    cfg = tiny()
    mha_cfg = dataclasses.replace(cfg, kv_heads=0)
    h, kv = cfg.hidden, KV_HEADS * cfg.hidden // HEADS
    torch.manual_seed(0)
    gqa, mha = Transformer(cfg), Transformer(mha_cfg)
    saved = cfg.layers * 2 * h * (h - kv)  # k and v of every block
    assert mha.num_parameters() - gqa.num_parameters() == saved
    assert total_params(from_config(mha_cfg, "x")) - total_params(from_config(cfg, "x")) == saved
    for shape, model in ((cfg, gqa), (mha_cfg, mha)):
        linear = sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear))
        assert matmul_params(shape)["layers"] == linear
    assert matmul_params(cfg)["attention"] == 2 * h * h + 2 * h * kv
    assert model_flops_per_token(mha_cfg, SEQ) - model_flops_per_token(cfg, SEQ) == 6 * saved
    assert from_config(cfg, "x").kv_heads == KV_HEADS and from_config(mha_cfg, "x").kv_heads == HEADS


def test_sdpa_takes_grouped_heads_without_a_mask_and_repeated_ones_with_a_dense_mask(monkeypatch):
    """FlashAttention reads grouped k/v but takes no mask; the memory-efficient kernel takes a
    mask but no grouped k/v: on CUDA, enable_gqa with a mask would fall to the math kernel."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs["enable_gqa"], kwargs["attn_mask"] is None))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    net = Transformer(tiny(objective="mlm"))
    ids = torch.randint(0, 97, (2, SEQ))
    net.trunk(ids)
    assert set(seen) == {(KV_HEADS, True, True)}
    seen.clear()
    net.trunk(ids, key_padding_mask=padding())
    assert set(seen) == {(HEADS, False, False)}
