"""Initial weights as a function of the seed and each parameter's name.

A parameter's starting value depends only on (seed, its name in the plain model, its
shape), never on the order in which a process happens to create tensors. So a model built
whole on one device, a pipeline stage that holds blocks 12-23 only, and a tensor- or
ZeRO-3-sharded parameter materialised from the meta device all start from the same
numbers, and every layout trains equal to one process.

The values: N(0, init_std) for every linear and embedding weight, zeros for biases, ones
for norm gains (the modules named *norm); with scaled_residual_init the projections that write into the residual
stream (attn.o_proj, mlp.down) get std / sqrt(2 * layers) (GPT-2). A tied output layer
starts as the embedding it is tied to.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from ember.config import ModelConfig
from ember.model.layers import Rotary, sinusoidal_table

RESIDUAL_OUTPUTS = ("attn.o_proj.weight", "mlp.down.weight")


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for the parameter `name` of a run seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(cfg: ModelConfig, name: str, shape: torch.Size, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The starting value (fp32) of the plain model's parameter `name`."""
    if cfg.tie_embeddings and name == "head.weight":
        name = "embed.weight"
    owner, _, leaf = name.rpartition(".")
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if owner.rpartition(".")[2].endswith("norm"):  # norm, attn_norm, mlp_norm: gains start at one
        return torch.ones(shape, device=device)
    std = cfg.init_std
    if cfg.scaled_residual_init and name.endswith(RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * cfg.layers)
    generator = torch.Generator(device=device).manual_seed(parameter_seed(seed, name))
    return torch.randn(shape, generator=generator, device=device).mul_(std)


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value)


@torch.no_grad()
def init_weights(module: nn.Module, cfg: ModelConfig, seed: int,
                 assign: Callable[[torch.Tensor, torch.Tensor], None] = _copy) -> None:
    """Give every parameter of `module` (the plain model, or a stage of it, whose names keep
    the plain model's) its initial value. `assign(param, value)` writes the whole value into
    the parameter; code that holds parameters sharded passes one that keeps its own slice
    (`ember.parallel.materialize`)."""
    for name, param in module.named_parameters():
        assign(param, initial_value(cfg, name, param.shape, seed, param.device))


@torch.no_grad()
def init_buffers(module: nn.Module, cfg: ModelConfig) -> None:
    """Recompute the fixed tables (rotary angles, sinusoidal positions) where they now live,
    after `to_empty` gave a meta-built model uninitialised memory."""
    for sub in module.modules():
        if isinstance(sub, Rotary):
            sub.reset()
    table = getattr(module, "pos_table", None)
    if isinstance(table, torch.Tensor) and not table.is_meta:
        table.copy_(sinusoidal_table(cfg.max_seq_len, cfg.hidden))

