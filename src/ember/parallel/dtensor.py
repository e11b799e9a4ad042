"""The one place that looks inside DTensors (tensor-parallel and FSDP2 parameters,
gradients and losses); everything else handles them through these two functions."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (the whole value of a replicated one); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(value: Any) -> Any:
    """The whole tensor of a DTensor, gathered from its shards (a collective every rank of its
    mesh must join); a plain tensor or a number as is."""
    return value.full_tensor() if isinstance(value, DTensor) else value
