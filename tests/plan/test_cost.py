"""The cost model against PyTorch's FLOP counter running the real model, and against the
Megatron-LM formula (Narayanan et al. 2021) derived independently."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ember.config import ModelConfig
from ember.model import Transformer
from ember.cost import forward_flops_per_token, matmul_params, model_flops_per_token


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=100, hidden=64, layers=2, heads=4, mlp_hidden=96, max_seq_len=64)
    return ModelConfig(**{**base, **overrides})


def counted_training_flops(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor) -> int:
    """FLOPs of one forward + backward, as torch.utils.flop_counter counts them.

    On a CPU, SDPA dispatches to `_scaled_dot_product_flash_attention_for_cpu`, which the
    counter has no formula for (it would count attention as 0). The math backend runs the
    same attention as two batched matmuls, which the counter does see: 4·B·h·T²·d forward
    and twice that backward, also under is_causal (the full square is computed and masked),
    the same convention as the counter's formula for the CUDA flash/efficient kernels."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(inputs, labels, reduction="sum").backward()
    return counter.get_total_flops()


def test_matmul_params_by_hand():
    gelu = matmul_params(tiny(activation="gelu"))
    assert gelu == {"attention": 4 * 64 * 64, "mlp": 2 * 64 * 96, "layer": 4 * 64 * 64 + 2 * 64 * 96,
                    "layers": 2 * (4 * 64 * 64 + 2 * 64 * 96), "output": 64 * 128}
    for gated in ("geglu", "swiglu"):
        assert matmul_params(tiny(activation=gated))["mlp"] == 3 * 64 * 96
    # Biases, norms and tying change parameters but not matmul weights.
    assert matmul_params(tiny(bias=True, tie_embeddings=False)) == gelu


@pytest.mark.parametrize("activation,positions,bias", [
    ("gelu", "learned", True), ("swiglu", "rotary", False), ("geglu", "sinusoidal", False),
])
def test_causal_dense_matches_flop_counter(activation, positions, bias):
    torch.manual_seed(0)
    cfg = tiny(objective="causal", activation=activation, positions=positions, bias=bias,
               tie_embeddings=activation != "swiglu")
    model = Transformer(cfg)
    batch, seq = 3, 48
    ids = torch.randint(0, 100, (batch, seq))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100  # an ignored target still passes through the output layer
    counted = counted_training_flops(model, ids, labels)
    predicted = model_flops_per_token(cfg, seq) * batch * seq
    # Exact up to float rounding: every matmul of the model is in the formula and vice versa.
    assert counted == pytest.approx(predicted, rel=1e-9)


@pytest.mark.parametrize("sparse", [True, False])
def test_masked_lm_matches_flop_counter(sparse):
    torch.manual_seed(0)
    cfg = tiny(objective="mlm", activation="geglu", positions="sinusoidal", sparse_prediction=sparse)
    model = Transformer(cfg)
    batch, seq = 4, 40
    ids = torch.randint(0, 100, (batch, seq))
    chosen = torch.rand(ids.shape) < 0.2
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    tokens, masked = batch * seq, int(chosen.sum())
    fraction = masked / tokens if sparse else 1.0
    counted = counted_training_flops(model, ids, labels)
    predicted = model_flops_per_token(cfg, seq, fraction) * tokens
    assert counted == pytest.approx(predicted, rel=1e-9)
    if sparse:  # and the saving is real: the dense formula would overcount
        assert counted < model_flops_per_token(cfg, seq, 1.0) * tokens * 0.99


def test_megatron_formula_for_gpt():
    """Narayanan et al. count 24·B·s·l·h²·(1 + s/6h + V/16lh) forward FLOPs for a GPT with a
    4h GELU MLP; without recomputation a step is 3x forward: 72·l·h²·(1 + s/6h + V/12lh)
    per token."""
    cfg = ModelConfig(objective="causal", vocab_size=50257, hidden=768, layers=12, heads=12,
                      mlp_hidden=3072, activation="gelu", max_seq_len=1024)
    s, l, h, v = 1024, 12, 768, cfg.padded_vocab
    megatron = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert model_flops_per_token(cfg, s) == pytest.approx(megatron, rel=1e-12)
    # GPT-2 small: ~124M parameters, so roughly 6N + attention ≈ 0.85 GFLOP per token.
    assert model_flops_per_token(cfg, s) == pytest.approx(8.5465e8, rel=1e-4)


def test_forward_is_a_third_and_fraction_is_checked():
    cfg = tiny()
    assert forward_flops_per_token(cfg, 32, 0.3) * 3 == pytest.approx(model_flops_per_token(cfg, 32, 0.3))
    assert model_flops_per_token(cfg, 64) - model_flops_per_token(cfg, 32) == pytest.approx(12 * 2 * 64 * 32)
    with pytest.raises(ValueError):
        model_flops_per_token(cfg, 32, 1.5)
