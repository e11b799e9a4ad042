"""The gradient norm and clipping of every layout: gradients may be DTensors on several
meshes (FSDP shards, tensor-parallel shards), and pipeline stages hold their pieces on
other ranks."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ember.parallel.dtensor import full_tensor, local_tensor


def clip_grad_norm(counted: Iterable[nn.Parameter], scaled: Iterable[nn.Parameter], max_norm: float,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of the gradients of `counted` over every rank holding a piece of them
    (the pieces of a DTensor's mesh; the other pipeline stages through `group`), and the
    gradients of `scaled` multiplied by min(1, max_norm / (norm + 1e-6)) as torch's
    clip_grad_norm_ does (max_norm inf: never). `scaled` may hold a second copy of a
    tied weight that `counted` leaves out, so that the copy is clipped but counted once."""
    grads = [p.grad for p in counted if p.grad is not None]
    by_mesh: dict[int | None, list[torch.Tensor]] = {}
    for g in grads:  # get_total_norm needs the gradients of one call on one mesh
        by_mesh.setdefault(id(g.device_mesh) if isinstance(g, DTensor) else None, []).append(g)
    device = grads[0].device if grads else _device(scaled)
    square = torch.zeros((), device=device, dtype=torch.float32)
    for same_mesh in by_mesh.values():
        square = square + full_tensor(torch.nn.utils.get_total_norm(same_mesh, 2.0)).float() ** 2
    if group is not None:
        dist.all_reduce(square, group=group)
    total = square.sqrt()
    if max_norm != float("inf"):
        # A tensor factor, not a float: reading the norm would wait for the device.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for p in scaled:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef.to(local_tensor(p.grad).dtype))
    return total


def _device(params: Iterable[nn.Parameter]) -> torch.device:
    for p in params:
        return local_tensor(p).device
    return torch.device("cpu")
