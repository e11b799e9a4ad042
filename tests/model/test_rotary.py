"""Rotary positions against a naive per-pair rotation, and the relative-position property."""

import math

import torch

from ember.config import ModelConfig
from ember.model import Transformer
from ember.model.layers import Rotary


def naive_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [T, d]. Pair i with i + d/2 and rotate the pair by pos * theta^(-2i/d), one at a time."""
    seq, dim = x.shape
    out = x.clone().double()
    for pos in range(seq):
        for i in range(dim // 2):
            angle = pos * theta ** (-2 * i / dim)
            a, b = float(x[pos, i]), float(x[pos, i + dim // 2])
            out[pos, i] = a * math.cos(angle) - b * math.sin(angle)
            out[pos, i + dim // 2] = a * math.sin(angle) + b * math.cos(angle)
    return out


def test_matches_naive_reference():
    torch.manual_seed(0)
    rotary = Rotary(head_dim=16, max_seq_len=40, theta=500.0)
    x = torch.randn(2, 3, 40, 16)  # [B, heads, T, head_dim]
    got = rotary(x)
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(got[b, h].double(), naive_rotary(x[b, h], 500.0), atol=1e-5, rtol=1e-5)


def test_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    rotary = Rotary(head_dim=32, max_seq_len=64, theta=10000.0)
    q, k = torch.randn(32), torch.randn(32)
    # The same query and key at every position: scores[i, j] must be a function of i - j.
    rq = rotary(q.expand(1, 1, 64, 32))[0, 0].double()
    rk = rotary(k.expand(1, 1, 64, 32))[0, 0].double()
    scores = rq @ rk.T
    for offset in (-20, -3, 0, 1, 7, 30):
        diagonal = torch.diagonal(scores, offset=offset)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4), offset
    # ...and not a constant: position does change the score.
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 5)[0], atol=1e-3)


def test_rotation_preserves_norms_and_leaves_position_zero_alone():
    rotary = Rotary(head_dim=8, max_seq_len=16, theta=10000.0)
    x = torch.randn(1, 2, 16, 8)
    y = rotary(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_model_uses_config_theta_and_rotates_queries_and_keys():
    cfg = ModelConfig(vocab_size=50, hidden=32, layers=1, heads=2, mlp_hidden=64, max_seq_len=16,
                      positions="rotary", rope_theta=1234.0)
    model = Transformer(cfg)
    rotary = model.blocks["0"].attn.rotary
    expected = Rotary(16, 16, 1234.0)
    torch.testing.assert_close(rotary.cos, expected.cos)
    torch.testing.assert_close(rotary.sin, expected.sin)
