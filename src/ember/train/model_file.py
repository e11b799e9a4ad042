"""The whole model as one `model.safetensors`: what `ember eval` and `ember export` read,
without torchrun, whatever layout trained it.

`save_model` gathers shards and pipeline stages to rank 0; `load_model` fills a plain
one-process model from that file or from a checkpoint folder (an interrupted run).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_model as load_safetensors
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ember.atomic import atomic_path
from ember.config import ConfigError
from ember.parallel.dtensor import full_tensor
from ember.train import checkpoint
from ember.train.checkpoint import barrier, rank, world


def save_model(parts: list[nn.Module], path: Path, step: int | None = None) -> None:
    """Write the model held by `parts` (on this rank; shards and stages on the others) as
    one safetensors file at `path`, written by rank 0; every rank calls it. `step`, the
    optimizer step the weights are from, goes into the file's metadata (`model_step`).

    Tensors travel one at a time: each is gathered whole from its shards by the ranks that
    hold it, the lowest of them sends it to rank 0, and the others drop it at once. Rank 0
    learns every tensor's name and shape first, so it writes the file's header up front and
    each tensor as it arrives: no rank ever holds more than its shards and one whole tensor
    (rank 0 two more, the embedding and a head that may be tied to it)."""
    local: dict[str, Any] = {}
    for part in parts:
        local.update(get_model_state_dict(part))
    names = sorted(local)
    mine = [(n, tuple(local[n].shape), local[n].dtype, _device_type(local[n])) for n in names]
    leaders, leader = {0: 0}, True
    if world() > 1:
        # Ranks holding the same names (the ranks of one pipeline stage) form one group, led
        # by its lowest rank; one 8-byte key per rank says which group a rank is in.
        key = torch.tensor([_names_key(names)], dtype=torch.int64)
        keys = [torch.zeros_like(key) for _ in range(world())]
        dist.all_gather(keys, key)
        leaders = {}  # group key -> its lowest rank
        for r, k in enumerate(keys):
            leaders.setdefault(int(k), r)
        leader = leaders[int(key)] == rank()
    if rank() > 0:
        if leader:
            dist.send_object_list([mine], dst=0)
        for name in names:  # every holder joins each gather in the same (sorted) order
            tensor = full_tensor(local[name]).detach()
            if leader:
                dist.send(tensor.contiguous(), dst=0)
            del tensor
        barrier()
        return
    # Rank 0 takes the listings, then its own group's tensors, then each other leader's in
    # rank order. Every rank takes its steps in that one global order: none waits on a step
    # that waits on it.
    sources = sorted(set(leaders.values()) - {0})
    listings = {0: mine}
    for source in sources:
        received: list[Any] = [None]
        dist.recv_object_list(received, src=source)
        listings[source] = received[0]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        writer = _Writer(handle, [entry for source in [0, *sources] for entry in listings[source]], step)
        for name in names:
            writer.add(name, full_tensor(local[name]).detach())
        for source in sources:
            for name, shape, dtype, device_type in listings[source]:
                buffer = torch.empty(shape, dtype=dtype, device=_receiving_device(device_type))
                dist.recv(buffer, src=source)
                writer.add(name, buffer)
        writer.finish()
    barrier()


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


class _Writer:
    """A safetensors file written one tensor at a time, in the order they arrive. The header
    (every name's dtype, shape and place) is known from the listings and written last into
    room kept for it at the start. A head of the embedding's shape goes last: when it
    equals the embedding (tied weights, sent by two stages) it is stored once and named in
    the metadata, as safetensors' own save_model does, so that its load_model re-ties them."""

    def __init__(self, handle, listing: list[tuple], step: int | None = None):
        self.handle, self.step = handle, step
        self.entries: dict[str, tuple[list[int], torch.dtype]] = {}
        for name, shape, dtype, _device in listing:
            self.entries.setdefault(name, (list(shape), dtype))
        self.tie = "embed.weight" in self.entries and self.entries.get("head.weight") == self.entries["embed.weight"]
        last = ["head.weight"] if self.tie else []
        order = [n for n in self.entries if n not in last] + last
        self.offsets, at = {}, 0
        for name in order:
            shape, dtype = self.entries[name]
            size = math.prod(shape) * dtype.itemsize
            self.offsets[name], at = (at, at + size), at + size
        self.held: dict[str, torch.Tensor] = {}
        self.written = 0
        self.room = max(len(self._header(tied)) for tied in (False, True))
        self.room += -self.room % 8  # safetensors aligns the data to 8 bytes
        handle.write(b"\0" * (8 + self.room))

    def _header(self, tied: bool) -> bytes:
        metadata = ({"format": "pt"} | ({"head.weight": "embed.weight"} if tied else {})
                    | ({"step": str(self.step)} if self.step is not None else {}))
        header: dict[str, Any] = {"__metadata__": metadata}
        for name, (shape, dtype) in self.entries.items():
            if not (tied and name == "head.weight"):
                header[name] = {"dtype": _DTYPES[dtype], "shape": shape, "data_offsets": list(self.offsets[name])}
        return json.dumps(header, separators=(",", ":")).encode()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.held or self.offsets[name][0] < self.written:
            return  # a second copy of a name already written
        if self.tie and name in ("embed.weight", "head.weight"):
            self.held[name] = tensor.to("cpu", copy=True)
            if name == "head.weight":
                return
        if self.offsets[name][0] != self.written:
            raise RuntimeError(f"{name} arrived out of the order its listing gave")
        self._put(tensor)

    def _put(self, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous().to("cpu").reshape(-1).view(torch.uint8).numpy()
        self.handle.write(data)
        self.written += data.nbytes

    def finish(self) -> None:
        tied = self.tie and torch.equal(self.held["embed.weight"], self.held["head.weight"])
        if self.tie and not tied:
            self._put(self.held["head.weight"])
        header = self._header(tied)
        self.handle.seek(0)
        self.handle.write(struct.pack("<Q", self.room) + header + b" " * (self.room - len(header)))


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


def model_step(path: Path) -> int | None:
    """The optimizer step a `model.safetensors` holds the weights of, or None for a file
    written before ember recorded it."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        step = (handle.metadata() or {}).get("step")
    return int(step) if step is not None and step.isdigit() else None


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
