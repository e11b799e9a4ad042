"""The model learns: a few optimizer steps on one fixed batch drive its loss down."""

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer


@pytest.mark.parametrize("objective,activation,positions", [
    ("causal", "swiglu", "rotary"), ("mlm", "geglu", "sinusoidal"), ("causal", "gelu", "learned"),
])
def test_overfits_a_fixed_batch(objective, activation, positions):
    torch.manual_seed(0)
    cfg = ModelConfig(objective=objective, activation=activation, positions=positions, vocab_size=100,
                      hidden=64, layers=2, heads=4, mlp_hidden=128, max_seq_len=32)
    model = Transformer(cfg)
    ids = torch.randint(0, 100, (4, 32))
    if objective == "causal":
        inputs, labels = ids, torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)
    else:
        chosen = torch.rand(ids.shape) < 0.25
        inputs = torch.where(chosen, torch.full_like(ids, 3), ids)  # 3 plays [MASK]
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = model(inputs, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(128.0)).item(), rel=0.1)  # starts near uniform
    assert losses[-1] < 0.5 * losses[0]
