"""The whole model as one `model.safetensors`: what `ember eval` and `ember export` read,
without torchrun, whatever layout trained it.

`save_model` gathers shards and pipeline stages to rank 0; `load_model` fills a plain
one-process model from that file or from a checkpoint folder (an interrupted run).
"""

from __future__ import annotations

import hashlib
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
    one safetensors file at `path`, written by rank 0; every rank calls it.

    Tensors travel one at a time: each is gathered whole from its shards by the ranks that
    hold it, the lowest of them sends it to rank 0, and the others drop it at once. So no
    rank but 0 ever holds more than its shards and one whole tensor, and rank 0 holds the
    model (which the one file needs) and nothing per rank."""
    local: dict[str, Any] = {}
    for part in parts:
        local.update(get_model_state_dict(part))
    names = sorted(local)
    if world() == 1:
        _write({name: full_tensor(local[name]).detach().to("cpu") for name in names}, Path(path))
        return
    # Ranks holding the same names (the ranks of one pipeline stage) form one group, led by
    # its lowest rank; one 8-byte key per rank says which group a rank is in.
    key = torch.tensor([_names_key(names)], dtype=torch.int64)
    keys = [torch.zeros_like(key) for _ in range(world())]
    dist.all_gather(keys, key)
    leaders: dict[int, int] = {}  # group key -> its lowest rank
    for r, k in enumerate(keys):
        leaders.setdefault(int(k), r)
    leader = leaders[int(key)] == rank()
    gathered: dict[str, torch.Tensor] = {}
    if leader and rank() > 0:
        dist.send_object_list([[(n, tuple(local[n].shape), local[n].dtype, _device_type(local[n])) for n in names]],
                              dst=0)
    # Every holder joins each gather in the same (sorted) order; rank 0 handles its own
    # group first, then receives the other leaders' tensors in rank order. All ranks take
    # their steps in one global order, so none waits on a step that waits on it.
    for name in names:
        tensor = full_tensor(local[name]).detach()
        if leader and rank() == 0:
            gathered[name] = tensor.to("cpu")
        elif leader:
            dist.send(tensor.contiguous(), dst=0)
        del tensor
    if rank() == 0:
        for source in sorted(set(leaders.values()) - {0}):
            listing: list[Any] = [None]
            dist.recv_object_list(listing, src=source)
            for name, shape, dtype, device_type in listing[0]:
                buffer = torch.empty(shape, dtype=dtype, device=_receiving_device(device_type))
                dist.recv(buffer, src=source)
                gathered.setdefault(name, buffer.to("cpu"))
        _write(gathered, Path(path))
    barrier()


def _names_key(names: list[str]) -> int:
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _device_type(value: Any) -> str:
    return value.device.type if isinstance(value, torch.Tensor) else "cpu"


def _receiving_device(device_type: str) -> torch.device:
    """Where rank 0 takes a tensor sent from a `device_type` tensor: the same kind of device,
    so the transfer runs over that device's backend (NCCL between GPUs)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


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
    if path.is_file():
        open(path, "rb").close()  # unreadable: an OSError naming the file, not "other weights"
    try:
        # load_model re-ties the weights save_model stored once.
        load_safetensors(model, str(path), strict=True, device="cpu")
    except (RuntimeError, OSError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path} does not hold weights for the model its config.toml describes ({first}); "
                          "point --checkpoint at an unmodified ember run directory.") from None
