"""The whole model as one `model.safetensors`: what `ember eval` and `ember export` read,
without torchrun, whatever layout trained it.

`save_model` gathers shards and pipeline stages to rank 0; `load_model` fills a plain
one-process model from that file or from a checkpoint folder (an interrupted run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_model as load_safetensors
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ember.atomic import atomic_path
from ember.config import ConfigError
from ember.parallel.dtensor import full_tensor
from ember.train import checkpoint
from ember.train.checkpoint import barrier, rank, world


def save_model(parts: list[nn.Module], path: Path) -> None:
    """Write the model held by `parts` (on this rank; shards and stages on the others) as
    one safetensors file at `path`, written by rank 0; every rank calls it."""
    local: dict[str, Any] = {}
    for part in parts:
        local.update(get_model_state_dict(part))
    names = sorted(local)
    owners: list[list[str]] = [names]
    if world() > 1:
        owners = [None] * world()  # type: ignore[list-item]
        dist.all_gather_object(owners, names)
    # Each name is sent by the lowest rank holding it; the others only take part in the
    # gathers (in the same order on every rank of a mesh) and drop the result at once.
    claimed = set().union(*owners[: rank()]) if rank() > 0 else set()
    mine: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = full_tensor(local[name]).detach().to("cpu")
        if name not in claimed:
            mine[name] = tensor
    if world() > 1:
        gathered: list[Any] = [None] * world() if rank() == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, gathered, dst=0)
        if rank() == 0:
            mine = {k: v for sent in gathered for k, v in sent.items()}
    if rank() == 0:
        _write(mine, Path(path))
    barrier()


def _write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # Stages on different ranks hold tied embedding and head as two equal copies; the plain
    # model holds one tensor, so store it once as safetensors' save_model does, or its
    # load_model refuses the file.
    embed, head = tensors.get("embed.weight"), tensors.get("head.weight")
    if embed is not None and head is not None and embed is not head and torch.equal(embed, head):
        tensors["head.weight"] = embed
    # Names sharing one tensor keep the alphabetically first, the others are recorded in the
    # metadata, exactly as safetensors' save_model does, so its load_model re-ties them.
    metadata = {"format": "pt"}
    kept: dict[tuple, str] = {}
    for name in sorted(tensors):
        tensor = tensors[name]
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() > 0 and where in kept:
            metadata[name] = kept[where]
            del tensors[name]
        else:
            kept.setdefault(where, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def load_model(model: nn.Module, path: Path) -> None:
    """Fill a plain one-process `model` from a `model.safetensors` file, or from a
    checkpoint folder written under any layout."""
    path = Path(path)
    if path.is_dir() and checkpoint.is_checkpoint(path):
        checkpoint.load(path, [model])
        return
    if path.is_dir():
        path = path / "model.safetensors"  # a checkpoint of an older ember keeps one inside
    try:
        # load_model re-ties the weights save_model stored once.
        load_safetensors(model, str(path), strict=True, device="cpu")
    except (RuntimeError, OSError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path} does not hold weights for the model its config.toml describes ({first}); "
                          "point --checkpoint at an unmodified ember run directory.") from None
