"""The process group and the device mesh of a run under torchrun.

Dims are ("pp", "dp_replicate", "dp_shard", "tp"), tp innermost so that the ranks of a
tensor-parallel group (the chattiest) are neighbours on one node. Data parallelism also
needs one flat "dp" group (dp_replicate x dp_shard) for the loader and for loss sums; it is
kept beside the mesh rather than sliced from it again, which newer PyTorch discourages.
"""

from __future__ import annotations

import datetime

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ember.layout import Layout

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
_FLAT_DP: dict[int, DeviceMesh] = {}  # id(root mesh) -> its flattened "dp" mesh


def env_world() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; (1, 0, 0) without it."""
    return (int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device, timeout_s: float | None = None) -> None:
    """Join the torchrun process group: NCCL for CUDA tensors, gloo for CPU tensors (the
    trainer sums small host counters over it without touching the GPU stream). Every
    collective fails after `timeout_s` seconds without its peers (None: PyTorch's default)."""
    if dist.is_initialized():
        return
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device, **timeout)
    else:
        dist.init_process_group(backend="gloo", **timeout)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    sizes = layout.sizes
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in DIMS), mesh_dim_names=DIMS)
    _FLAT_DP[id(mesh)] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened 1-D "dp" mesh (dp_replicate x dp_shard) of a mesh from `build_mesh`."""
    return _FLAT_DP[id(mesh)]


@dataclass
class Topology:
    """Where this process sits in the layout; a single process has no mesh at all."""

    world: int = 1
    rank: int = 0
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def size(self, dim: str) -> int:
        """Ranks along a mesh dim, along the flat "dp", or in the whole "world"."""
        if dim == "world" or self.mesh is None:
            return self.world if dim == "world" else 1
        return dp_mesh(self.mesh).size() if dim == "dp" else self.mesh[dim].size()

    def coordinate(self, dim: str) -> int:
        if self.mesh is None:
            return 0
        return dp_mesh(self.mesh).get_local_rank() if dim == "dp" else self.mesh.get_local_rank(dim)

    def group(self, dim: str):
        if self.mesh is None or dim == "world":
            return None  # the default group
        return dp_mesh(self.mesh).get_group() if dim == "dp" else self.mesh.get_group(dim)

    def all_reduce(self, tensor: torch.Tensor, dims: tuple[str, ...], op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce in place over each named dim whose size exceeds 1; a no-op alone."""
        for dim in dims:
            if self.size(dim) > 1:
                dist.all_reduce(tensor, op=op, group=self.group(dim))
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()
