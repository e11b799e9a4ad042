"""Shapes, parameter counts, tying, masking and the sparse-prediction loss of Transformer."""

import dataclasses
import math

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=100, hidden=64, layers=2, heads=4, mlp_hidden=96, max_seq_len=32)
    return ModelConfig(**{**base, **overrides})


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


# Every value of every option appears at least twice, without the full product.
COMBOS = [
    ("causal", "gelu", "layernorm", "learned"),
    ("causal", "swiglu", "rmsnorm", "rotary"),
    ("causal", "geglu", "layernorm", "sinusoidal"),
    ("mlm", "geglu", "layernorm", "sinusoidal"),
    ("mlm", "gelu", "rmsnorm", "rotary"),
    ("mlm", "swiglu", "rmsnorm", "learned"),
]


@pytest.mark.parametrize("objective,activation,norm,positions", COMBOS)
def test_shapes_loss_and_gradients(objective, activation, norm, positions):
    cfg = tiny(objective=objective, activation=activation, norm=norm, positions=positions)
    model = build(cfg)
    ids = torch.randint(0, 100, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 128)
    assert torch.isfinite(logits).all()
    labels = ids.clone()
    labels[:, ::3] = -100
    loss = model(ids, labels)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    # Norm types and MLP layout are what the config says.
    norm_type = torch.nn.RMSNorm if norm == "rmsnorm" else torch.nn.LayerNorm
    assert isinstance(model.norm, norm_type) and isinstance(model.blocks["0"].attn_norm, norm_type)
    assert (model.blocks["0"].mlp.gate is None) == (activation == "gelu")


def test_bias_adds_exactly_the_expected_parameters():
    for norm in ("layernorm", "rmsnorm"):
        for activation in ("gelu", "swiglu"):
            cfg = tiny(norm=norm, activation=activation)
            without = build(dataclasses.replace(cfg, bias=False)).num_parameters()
            with_bias = build(dataclasses.replace(cfg, bias=True)).num_parameters()
            h, m = cfg.hidden, cfg.mlp_hidden
            per_layer = 4 * h + (2 if activation == "swiglu" else 1) * m + h  # q,k,v,o; up(,gate); down
            norms = (2 * cfg.layers + 1) * h if norm == "layernorm" else 0  # RMSNorm has no bias
            assert with_bias - without == cfg.layers * per_layer + norms


def test_parameter_count_by_hand():
    cfg = tiny(activation="gelu", norm="rmsnorm", positions="rotary", bias=False)
    h, m, v = 64, 96, 128
    layer = 4 * h * h + 2 * h * m + 2 * h  # projections, two RMSNorm gains
    assert build(cfg).num_parameters() == v * h + 2 * layer + h
    untied = build(dataclasses.replace(cfg, tie_embeddings=False))
    assert untied.num_parameters() == 2 * v * h + 2 * layer + h
    assert untied.num_parameters(exclude_embeddings=True) == v * h + 2 * layer + h


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = build(tiny(tie_embeddings=True))
    assert tied.head.weight is tied.embed.weight
    state = tied.state_dict()
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    untied = build(tiny(tie_embeddings=False))
    assert untied.head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert untied.head.bias is None and tied.head.bias is None


@pytest.mark.parametrize("vocab,padded", [(100, 128), (128, 128), (129, 256), (1, 128)])
def test_vocabulary_is_padded(vocab, padded):
    model = build(tiny(vocab_size=vocab))
    assert model.embed.weight.shape == (padded, 64)
    assert model.head.weight.shape == (padded, 64)


def test_positions_live_where_they_should():
    learned = build(tiny(positions="learned"))
    assert learned.pos_embed.weight.shape == (32, 64) and learned.pos_table is None
    sinus = build(tiny(positions="sinusoidal"))
    assert sinus.pos_embed is None and sinus.pos_table.shape == (32, 64)
    rotary = build(tiny(positions="rotary"))
    # Derived buffers stay out of checkpoints.
    for model in (sinus, rotary):
        assert not any("pos_table" in k or "cos" in k or "sin" in k for k in model.state_dict())
    # Without any position information a causal LM still orders tokens through its mask,
    # but a masked LM would be permutation-equivariant; each positional scheme breaks that.
    ids = torch.randint(0, 100, (1, 12))
    perm = torch.randperm(12)
    for positions in ("learned", "sinusoidal", "rotary"):
        model = build(tiny(objective="mlm", positions=positions)).eval()
        with torch.no_grad():
            assert not torch.allclose(model(ids)[:, perm], model(ids[:, perm]), atol=1e-5), positions


def test_sinusoidal_table_values():
    from ember.model.layers import sinusoidal_table

    table = sinusoidal_table(50, 64).double()
    for pos, i in [(0, 0), (3, 0), (7, 5), (49, 31)]:
        angle = pos / 10000 ** (2 * i / 64)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle) / 8, abs=1e-7)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle) / 8, abs=1e-7)
    # Scaled by 1/sqrt(hidden): every position vector has norm sqrt(1/2).
    torch.testing.assert_close(table.norm(dim=1), torch.full((50,), math.sqrt(0.5), dtype=torch.float64))
    assert sinusoidal_table(10, 7).shape == (10, 7)  # odd widths work too


def test_too_long_a_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        build(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_unresolved_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(tiny(vocab_size=0))


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal_attention_does_not_see_the_future(positions):
    model = build(tiny(objective="causal", positions=positions)).eval()
    ids = torch.randint(0, 100, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 100
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_masked_lm_attends_both_ways():
    model = build(tiny(objective="mlm")).eval()
    ids = torch.randint(0, 100, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 100
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert not torch.allclose(a[:, :12], b[:, :12])


def _mlm_labels(ids: torch.Tensor, rate: float = 0.25, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(ids.shape, generator=generator) < rate
    return torch.where(chosen, ids, torch.full_like(ids, -100))


def test_sparse_prediction_gives_the_dense_loss_on_masked_rows_only():
    model = build(tiny(objective="mlm", sparse_prediction=True)).eval()
    ids = torch.randint(0, 100, (4, 24))
    labels = _mlm_labels(ids)
    count = int((labels != -100).sum())
    assert 0 < count < ids.numel()
    seen = []
    handle = model.head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        sparse = model(ids, labels)
        sparse_sum = model(ids, labels, reduction="sum")
        model.cfg.sparse_prediction = False  # the same weights, the dense path
        dense = model(ids, labels)
        dense_sum = model(ids, labels, reduction="sum")
    handle.remove()
    assert seen[0] == (count, 64)  # the head ran on the masked positions alone
    assert seen[2] == (4, 24, 64)
    assert abs(sparse.item() - dense.item()) < 1e-6
    assert sparse_sum.item() == pytest.approx(sparse.item() * count, rel=1e-6)
    assert dense_sum.item() == pytest.approx(sparse_sum.item(), rel=1e-6)


def test_loss_matches_cross_entropy_of_logits_and_ignores_unlabelled():
    model = build(tiny(objective="causal")).eval()
    ids = torch.randint(0, 100, (2, 16))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        logits = model(ids)
        expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, :-1].reshape(-1))
        assert model(ids, labels).item() == pytest.approx(expected.item(), rel=1e-6)
        assert model(ids, labels, reduction="sum").item() == pytest.approx(expected.item() * 30, rel=1e-6)


def test_dropout_only_in_training():
    model = build(tiny(dropout=0.2))
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert not torch.allclose(model(ids), model(ids))
        model.eval()
        assert torch.equal(model(ids), model(ids))


def test_key_padding_mask_hides_pads_from_a_masked_lm():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(objective="mlm", vocab_size=100, hidden=32, layers=2, heads=2,
                                    mlp_hidden=64, max_seq_len=16)).eval()
    ids = torch.randint(5, 100, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    real = torch.arange(10)[None, :] < 6
    alone = model.trunk(ids)
    masked = model.trunk(padded, key_padding_mask=real)[:, :6]
    unmasked = model.trunk(padded)[:, :6]
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-4)
