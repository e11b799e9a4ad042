"""Token ids to (inputs, labels): causal next-token targets or BERT masking.

Labels are -100 wherever nothing is predicted, the value cross-entropy ignores.

Every random draw of the masking is a hash of (seed, global row, column, purpose): a
sequence gets the same mask whichever batch, micro-batch or data-parallel rank it lands
in, and a resumed run draws the same masks without saving any random state. That is what
lets a layout of many processes be checked against one process on the same batch.
"""

from __future__ import annotations

import torch

from ember.config import DataConfig
from ember.data.errors import DataError

IGNORE = -100
_NEVER_MASKED = ("sep", "pad", "cls", "mask", "unk")


def held_out_seed(data_seed: int) -> int:
    """The masking seed of held-out evaluation: fixed, and apart from training's."""
    return data_seed + 1


def causal_targets(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplication wraps; shifts made logical)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform(seed: int, purpose: int, first_row: int, shape: tuple[int, int], device=None) -> torch.Tensor:
    """Uniform [0, 1) draws, one per (row, column), a pure function of their coordinates."""
    rows = torch.arange(first_row, first_row + shape[0], dtype=torch.int64, device=device)
    cols = torch.arange(shape[1], dtype=torch.int64, device=device)
    key = _mix(torch.tensor(_signed((seed * 0x9E3779B1 + purpose * 0x85EBCA77) % (1 << 64)), dtype=torch.int64))
    counter = (rows[:, None] << 24) + cols[None, :]
    x = _mix(counter * _GOLDEN + key.to(device))
    return ((x >> 11) & ((1 << 53) - 1)).double().mul_(2.0 ** -53).float()


def mlm_targets(ids: torch.Tensor, cfg: DataConfig, special_tokens: dict, vocab_size: int,
                seed: int, first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    mask_id = special_tokens.get("mask")
    if mask_id is None:
        raise DataError("these shards' tokenizer has no mask token; prepare with --tokenizer wordpiece or bpe.")
    specials = [special_tokens[r] for r in _NEVER_MASKED if special_tokens.get(r) is not None]
    eligible = ~torch.isin(ids, torch.tensor(specials, dtype=ids.dtype, device=ids.device))
    draw = uniform(seed, 0, first_row, ids.shape, ids.device)
    chosen = (draw < cfg.mlm_rate) & eligible
    if not chosen.any() and eligible.any():
        # A step with no target would divide its loss by zero; take the likeliest position.
        lowest = torch.where(eligible, draw, 2.0).argmin()
        chosen.view(-1)[lowest] = True
    action = uniform(seed, 1, first_row, ids.shape, ids.device)
    random_ids = (uniform(seed, 2, first_row, ids.shape, ids.device) * vocab_size).long().clamp_(max=vocab_size - 1)
    to_mask = chosen & (action < cfg.mask_token_frac)
    to_random = chosen & ~to_mask & (action < cfg.mask_token_frac + cfg.random_token_frac)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, random_ids, inputs)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    return inputs, labels


def make_targets(ids: torch.Tensor, objective: str, data_cfg: DataConfig, special_tokens: dict,
                 vocab_size: int, seed: int, first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) for `objective` "causal" or "mlm" from a (batch, seq) LongTensor
    whose rows are the global sequences first_row, first_row + 1, ..."""
    if objective == "causal":
        return causal_targets(ids)
    if objective == "mlm":
        return mlm_targets(ids, data_cfg, special_tokens, vocab_size, seed, first_row)
    raise DataError(f"objective {objective!r} is unknown; use mlm or causal.")
