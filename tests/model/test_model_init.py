"""Initialisation: reproducible from the seed, with the documented standard deviations."""

import math

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer


def cfg(**overrides) -> ModelConfig:
    base = dict(vocab_size=500, hidden=128, layers=8, heads=4, mlp_hidden=256, max_seq_len=64,
                positions="learned", activation="swiglu", bias=True, init_std=0.02)
    return ModelConfig(**{**base, **overrides})


def build(config: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config)


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = build(cfg(), 3), build(cfg(), 3), build(cfg(), 4)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.blocks["0"].attn.q_proj.weight, c.blocks["0"].attn.q_proj.weight)


@pytest.mark.parametrize("scaled", [True, False])
def test_standard_deviations(scaled):
    model = build(cfg(scaled_residual_init=scaled), 0)
    residual = 0.02 / math.sqrt(2 * 8) if scaled else 0.02  # 0.005 with 8 layers
    # Pool each kind of weight over the layers: ~65k-260k samples, so 5% is many sigmas.
    def pooled(get):
        return torch.cat([get(block).flatten() for block in model.blocks.values()])

    for get, std in [
        (lambda b: b.attn.q_proj.weight, 0.02), (lambda b: b.attn.v_proj.weight, 0.02),
        (lambda b: b.mlp.gate.weight, 0.02), (lambda b: b.mlp.up.weight, 0.02),
        (lambda b: b.attn.o_proj.weight, residual), (lambda b: b.mlp.down.weight, residual),
    ]:
        values = pooled(get)
        assert abs(values.mean().item()) < 0.1 * std
        assert values.std().item() == pytest.approx(std, rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.pos_embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0, name
        if "norm" in name and name.endswith("weight"):
            assert torch.equal(param, torch.ones_like(param)), name
