"""make_targets: causal shift and BERT masking."""

import pytest
import torch

from ember.config import DataConfig
from ember.data import DataError, make_targets

SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
VOCAB = 1000


def _ids(shape=(64, 512), seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, shape, generator=gen)


def test_causal_labels_are_the_next_token():
    ids = _ids((3, 10))
    inputs, labels = make_targets(ids, "causal", DataConfig(), SPECIALS, VOCAB, seed=0)
    assert torch.equal(inputs, ids)
    assert torch.equal(labels[:, :-1], ids[:, 1:])
    assert (labels[:, -1] == -100).all()


def test_mlm_rate_and_80_10_10_split():
    ids = _ids()
    inputs, labels = make_targets(ids, "mlm", DataConfig(), SPECIALS, VOCAB, seed=1)
    chosen = labels != -100
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    assert torch.equal(labels[chosen], ids[chosen])
    n = chosen.sum().item()
    masked = (inputs[chosen] == SPECIALS["mask"]).sum().item() / n
    unchanged = (inputs[chosen] == ids[chosen]).sum().item() / n
    randomised = 1 - masked - unchanged
    assert abs(masked - 0.8) < 0.03 and abs(unchanged - 0.1) < 0.03 and abs(randomised - 0.1) < 0.03
    assert torch.equal(inputs[~chosen], ids[~chosen])  # nothing outside the chosen positions changes


def test_mlm_follows_the_config():
    cfg = DataConfig(mlm_rate=0.4, mask_token_frac=0.5, random_token_frac=0.0)
    ids = _ids()
    inputs, labels = make_targets(ids, "mlm", cfg, SPECIALS, VOCAB, seed=2)
    chosen = labels != -100
    assert abs(chosen.float().mean().item() - 0.4) < 0.01
    masked = (inputs[chosen] == SPECIALS["mask"]).float().mean().item()
    assert abs(masked - 0.5) < 0.02
    assert ((inputs[chosen] == SPECIALS["mask"]) | (inputs[chosen] == ids[chosen])).all()


def test_special_tokens_are_never_chosen():
    ids = _ids()
    ids[:, ::2] = torch.tensor(list(SPECIALS.values())).repeat(ids.shape[1] // 10 + 1)[: ids.shape[1] // 2]
    cfg = DataConfig(mlm_rate=0.9, mask_token_frac=0.8, random_token_frac=0.1)
    inputs, labels = make_targets(ids, "mlm", cfg, SPECIALS, VOCAB, seed=3)
    assert (labels[:, ::2] == -100).all()
    assert torch.equal(inputs[:, ::2], ids[:, ::2])
    assert (labels[:, 1::2] != -100).float().mean().item() > 0.85


def test_mlm_is_deterministic_given_the_seed():
    ids = _ids((8, 64))
    a = make_targets(ids, "mlm", DataConfig(), SPECIALS, VOCAB, seed=11)
    b = make_targets(ids, "mlm", DataConfig(), SPECIALS, VOCAB, seed=11)
    c = make_targets(ids, "mlm", DataConfig(), SPECIALS, VOCAB, seed=12)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_a_batch_always_has_a_target():
    ids = _ids((1, 8))
    cfg = DataConfig(mlm_rate=1e-9)
    for seed in range(5):
        _, labels = make_targets(ids, "mlm", cfg, SPECIALS, VOCAB, seed=seed)
        assert (labels != -100).sum().item() == 1


def test_mlm_without_a_mask_token_is_refused():
    with pytest.raises(DataError, match="no mask token"):
        make_targets(_ids((2, 8)), "mlm", DataConfig(), {"sep": 3, "pad": 3, "mask": None}, VOCAB, seed=0)
    with pytest.raises(DataError, match="mlm or causal"):
        make_targets(_ids((2, 8)), "prefix", DataConfig(), SPECIALS, VOCAB, seed=0)


def test_masks_do_not_depend_on_how_rows_are_batched():
    # The same global rows get the same masks in one batch or split across micro-batches
    # or ranks: what makes a multi-process layout comparable with one process.
    ids = _ids((8, 64))
    whole = make_targets(ids, "mlm", DataConfig(), SPECIALS, VOCAB, seed=5, first_row=100)
    halves = [make_targets(ids[i:i + 4], "mlm", DataConfig(), SPECIALS, VOCAB, seed=5, first_row=100 + i)
              for i in (0, 4)]
    for part in (0, 1):
        assert torch.equal(whole[part], torch.cat([h[part] for h in halves]))
    shifted = make_targets(ids, "mlm", DataConfig(), SPECIALS, VOCAB, seed=5, first_row=101)
    assert not torch.equal(whole[1], shifted[1])
