"""The cost model's extensions for the planner: grouped-query attention, per-matmul shapes,
recomputation FLOPs. ModelConfig without kv_heads keeps its numbers; test_cost.py checks those."""

import dataclasses

import pytest

from ember.config import ModelConfig
from ember.cost import layer_matmuls, matmul_params, model_flops_per_token, recompute_flops_per_token
from ember.plan.models import PRESETS, from_config


def test_grouped_query_attention_has_smaller_kv_projections():
    llama = PRESETS["llama3-8b"]  # h 4096, 8 of 32 heads for K and V: h_kv = 1024
    assert matmul_params(llama)["attention"] == 2 * 4096**2 + 2 * 4096 * 1024
    mha = llama.with_shape(kv_heads=32)
    assert matmul_params(mha)["attention"] == 4 * 4096**2


def test_layer_matmuls_add_up_and_match_modelconfig():
    for spec in PRESETS.values():
        assert sum(k * n for k, n in layer_matmuls(spec).values()) == matmul_params(spec)["layer"]
    cfg = ModelConfig(vocab_size=50257, activation="swiglu", hidden=512, heads=8, mlp_hidden=1376, layers=4)
    for config in (cfg, dataclasses.replace(cfg, kv_heads=2)):  # multi-head and grouped-query attention
        spec = from_config(config, "x")
        assert matmul_params(spec) == matmul_params(config)
        assert model_flops_per_token(spec, 256) == model_flops_per_token(config, 256)
    assert matmul_params(dataclasses.replace(cfg, kv_heads=2))["attention"] == 2 * 512**2 + 2 * 512 * 128


def test_recompute_flops_match_megatrons_hardware_formula():
    """Narayanan et al. count 96·B·s·l·h²·(1 + s/6h + V/16lh) per step with full recomputation:
    per token 96·l·h² + 16·l·h·s + 6·V·h, i.e. model FLOPs plus one more forward of the blocks."""
    gpt = PRESETS["gpt3-175b"]
    s, l, h, v = 2048, gpt.layers, gpt.hidden, gpt.padded_vocab
    hardware = model_flops_per_token(gpt, s) + recompute_flops_per_token(gpt, s, "full")
    assert hardware == pytest.approx(96 * l * h * h + 16 * l * h * s + 6 * v * h, rel=1e-12)
    assert recompute_flops_per_token(gpt, s, "selective-attention") == 4 * l * h * s  # Megatron-LM's
    assert recompute_flops_per_token(gpt, s, "selective") == 0.0  # ember's reruns no matmul
    # torchtitan's op-level policy reruns every other matmul of the blocks, not their attention:
    # half of what full recomputation reruns beyond the attention core, 12·l·h² of its 24·l·h².
    full_matmuls = recompute_flops_per_token(gpt, s, "full") - 4 * l * h * s
    assert full_matmuls == pytest.approx(24 * l * h * h, rel=1e-3)
    assert recompute_flops_per_token(gpt, s, "selective-half-matmul") == pytest.approx(full_matmuls / 2, rel=1e-12)
    assert recompute_flops_per_token(gpt, s, "none") == 0
    with pytest.raises(ValueError):
        recompute_flops_per_token(gpt, s, "most")
