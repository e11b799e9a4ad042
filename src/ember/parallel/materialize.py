"""Giving a model built on the meta device real memory, each rank only its own share.

The trainer builds the Transformer on the meta device (shapes, no storage), applies tensor
parallelism, recomputation, compile and data parallelism to it, and only then calls
`materialize`: `to_empty` allocates what this rank holds after all of that (its tensor-
parallel slice, its ZeRO-3 shard, its pipeline stages), and `ember.model.init` fills it
with the values the whole model would have had. So no rank ever allocates the whole
model; the one whole tensor a rank makes is the value of one parameter at a time, which it
cuts to its slice at once (`init_weights`).

A model too big for the device is refused in one sentence before anything is allocated:
this rank's bytes are known exactly from the meta tensors (each parameter's and buffer's
local piece, after every layout has cut them), and so is the one whole value made at a
time. The allocator's own out-of-memory error, where the estimate fell short, says the same.
"""

from __future__ import annotations

import contextlib
import gc
import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ember.config import ModelConfig
from ember.device import available_memory_bytes
from ember.errors import ConfigError
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


GIB = 2**30
# How the allocators say they ran out: CUDA raises its own type, the CPU a RuntimeError.
_CPU_OUT_OF_MEMORY = "can't allocate memory"


def materialized_bytes(module: nn.Module) -> int:
    """Bytes `materialize` allocates on this rank at its peak: the local piece of every
    parameter and buffer (a shared one once), plus the largest whole fp32 value
    `init_weights` makes before cutting it to this rank's slice."""
    held, seen = 0, set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            local = local_tensor(t)
            held += local.numel() * local.element_size()
    whole = max((p.numel() * 4 for p in module.parameters()), default=0)  # a DTensor's numel is the whole's
    return held + whole


def does_not_fit(need: int, device: torch.device, have: int | None = None) -> str:
    """The refusal; without `have`, the allocator ran out (fragmentation, other processes)
    although the free memory had seemed enough, or the free memory is not known."""
    room = f"has {have / GIB:.1f} GiB available" if have is not None else "ran out of memory allocating it"
    return (f"the model does not fit: building this rank's share of its weights needs {need / GIB:.1f} GiB "
            f"but {device} {room}; choose a smaller model (model.hidden, model.mlp_hidden, model.layers) or "
            "spread it over more ranks under torchrun (parallel.zero=3, parallel.tp).")


def _out_of_memory(err: RuntimeError) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or _CPU_OUT_OF_MEMORY in str(err)


@torch.no_grad()
def materialize(module: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> nn.Module:
    """Allocate `module`'s parameters and buffers on `device` and initialise them by name;
    a ConfigError, before any allocation where it can be known, if they do not fit."""
    need, have = materialized_bytes(module), available_memory_bytes(device)
    if have is not None and need > have:
        raise ConfigError(does_not_fit(need, device, have))
    try:
        with _swap_on_conversion():
            module.to_empty(device=device)
        init_weights(module, cfg, seed, assign=_keep_slice)
        init_buffers(module, cfg)
    except RuntimeError as err:
        if not _out_of_memory(err):
            raise
        raise ConfigError(does_not_fit(need, device)) from None
    # The whole values cut to this rank's slices leave reference cycles behind (DTensor
    # wrappers); without a collection their memory stays held into the first steps.
    gc.collect()
    return module
