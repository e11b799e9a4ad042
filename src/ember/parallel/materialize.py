"""Giving a model built on the meta device real memory, each rank only its own share.

The trainer builds the Transformer on the meta device (shapes, no storage), applies tensor
parallelism, recomputation, compile and data parallelism to it, and only then calls
`materialize`: `to_empty` allocates what this rank holds after all of that (its tensor-
parallel slice, its ZeRO-3 shard, its pipeline stages), and `ember.model.init` fills it
with the values the whole model would have had. So no rank ever allocates the whole
model; the one whole tensor a rank makes is the value of one parameter at a time, which it
cuts to its slice at once (`init_weights`).
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ember.config import ModelConfig
from ember.model.init import init_buffers, init_weights
from ember.parallel.dtensor import local_tensor


@contextlib.contextmanager
def _swap_on_conversion():
    # With swapping, `to_empty` keeps each Parameter object (its storage is swapped in place),
    # so a tied output layer stays the embedding's weight and FSDP2 keeps its references.
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _keep_slice(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Write this rank's slice of the whole value. Every rank computed the same whole value,
    so each cuts its own without communication (src_data_rank=None)."""
    if isinstance(param, DTensor):
        whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    local_tensor(param).copy_(local_tensor(whole))


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters())


@torch.no_grad()
def materialize(module: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> nn.Module:
    """Allocate `module`'s parameters and buffers on `device` and initialise them by name."""
    with _swap_on_conversion():
        module.to_empty(device=device)
    init_weights(module, cfg, seed, assign=_keep_slice)
    init_buffers(module, cfg)
    # The whole values cut to this rank's slices leave reference cycles behind (DTensor
    # wrappers); without a collection their memory stays held into the first steps.
    gc.collect()
    return module
