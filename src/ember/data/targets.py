"""Token ids to (inputs, labels): causal next-token targets or BERT masking.

Labels are -100 wherever nothing is predicted, the value cross-entropy ignores. Masks
come from a generator seeded by the caller (from data seed and position), so a resumed
run draws the same masks without saving any random state.
"""

from __future__ import annotations

import torch

from ember.config import DataConfig
from ember.data.errors import DataError

IGNORE = -100
_NEVER_MASKED = ("sep", "pad", "cls", "mask", "unk")


def causal_targets(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def mlm_targets(ids: torch.Tensor, cfg: DataConfig, special_tokens: dict, vocab_size: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask_id = special_tokens.get("mask")
    if mask_id is None:
        raise DataError("these shards' tokenizer has no mask token; prepare with --tokenizer wordpiece or bpe.")
    gen = torch.Generator(device=ids.device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    specials = [special_tokens[r] for r in _NEVER_MASKED if special_tokens.get(r) is not None]
    eligible = ~torch.isin(ids, torch.tensor(specials, dtype=ids.dtype, device=ids.device))
    draw = torch.rand(ids.shape, generator=gen, device=ids.device)
    chosen = (draw < cfg.mlm_rate) & eligible
    if not chosen.any() and eligible.any():
        # A step with no target would divide its loss by zero; take the likeliest position.
        lowest = torch.where(eligible, draw, 2.0).argmin()
        chosen.view(-1)[lowest] = True
    action = torch.rand(ids.shape, generator=gen, device=ids.device)
    random_ids = torch.randint(0, vocab_size, ids.shape, generator=gen, device=ids.device, dtype=ids.dtype)
    to_mask = chosen & (action < cfg.mask_token_frac)
    to_random = chosen & ~to_mask & (action < cfg.mask_token_frac + cfg.random_token_frac)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, random_ids, inputs)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    return inputs, labels


def make_targets(ids: torch.Tensor, objective: str, data_cfg: DataConfig, special_tokens: dict,
                 vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) for `objective` "causal" or "mlm" from a (batch, seq) LongTensor."""
    if objective == "causal":
        return causal_targets(ids)
    if objective == "mlm":
        return mlm_targets(ids, data_cfg, special_tokens, vocab_size, seed)
    raise DataError(f"objective {objective!r} is unknown; use mlm or causal.")
