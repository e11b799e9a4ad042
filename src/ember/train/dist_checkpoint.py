"""Sharded checkpoints that any parallel layout, or one process, can load.

A sharded checkpoint is a folder `RUN_DIR/checkpoints/step_00000123/` (the naming of
`train/checkpoint.py`, so `latest_checkpoint` finds both kinds) holding:

- the `torch.distributed.checkpoint` files (`.metadata` and one `*.distcp` per writing
  rank): model parameters under `model.<FQN>` and AdamW states under
  `optim.state.<FQN>.<name>` / `optim.param_groups.<FQN>.<name>`, where FQN is the plain
  Transformer's parameter name ("blocks.3.attn.q_proj.weight"). Wrappers (DDP, FSDP2,
  compile, activation checkpointing) are stripped and DTensor shards (FSDP, tensor
  parallel) are stored as pieces of the whole tensor, so the keys and shapes do not
  depend on the layout that wrote them and any other layout re-slices them on load;
- `rng/rank_NNNNN.pt`, each rank's torch RNG state, restored only when the loading layout
  (world size and every parallel degree) is the saving one; see `restores_rng`;
- `sharded.json` (world size and parallel degrees at save time) and `state.json`
  (progress and data position, the `state` the trainer passes), written by rank 0.

Every rank writes into `step_N.tmp/`; after a barrier rank 0 fsyncs and renames it, so a
crash at any moment leaves the newest complete checkpoint loadable.

`load_sharded` also reads a one-process checkpoint of `train/checkpoint.py` into any
layout, so a run started on one device can go on under torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from ember.config import ConfigError
from ember.train.checkpoint import PREFIX, list_checkpoints, rng_state, set_rng_state

LAYOUT_FILE = "sharded.json"
# Per-FQN optimizer keys (instead of integer parameter ids) are what let one optimizer per
# pipeline part be merged with, and split back into, any other set of parts.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
# How this process runs the update (kernels for its device), not training state: a
# checkpoint from GPUs must not switch a CPU run to fused kernels, or back.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    # DCP warns that it assumes one process when there is no process group: that is the
    # intended use here (resuming a sharded run on one device), not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded(path: Path) -> bool:
    """True for a checkpoint folder written by `save_sharded`."""
    return (Path(path) / LAYOUT_FILE).is_file()


def _collect(parts: list[nn.Module], optimizers: list[Optimizer] | None,
             aliases: bool = False) -> tuple[dict, list[list[str]], list[list[str]]]:
    """The state dict of all parts keyed by FQN, and which keys belong to which part."""
    if optimizers is not None and len(optimizers) != len(parts):
        raise ValueError(f"{len(parts)} model parts but {len(optimizers)} optimizers; pass one optimizer per part.")
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    model_keys, optim_keys = [], []
    for i, part in enumerate(parts):
        sd = get_model_state_dict(part)
        model_keys.append(list(sd))
        model.update(sd)
        if optimizers is not None:
            osd = get_optimizer_state_dict(part, optimizers[i], options=_OPTIM)
            if aliases:
                osd = _with_aliases(osd, part)
            optim_keys.append(list(osd))
            optim.update(osd)
    state = {"model": model}
    if optimizers is not None:
        state["optim"] = optim
    return state, model_keys, optim_keys


def _with_aliases(osd: dict[str, Any], part: nn.Module) -> dict[str, Any]:
    """Also key the states of a tied parameter (embedding and output layer) under its other
    names. The optimizer keys it by one name only, but a pipeline's last stage holds the
    output layer alone and must find its states under "head.weight"."""
    try:  # what get_model_state_dict uses to strip wrapper prefixes (private, present since 2.2)
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:
        return osd
    names: dict[int, list[str]] = {}
    for name, param in part.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).extend(sorted(_get_fqns(part, name)))
    out = dict(osd)
    for fqns in (f for f in names.values() if len(f) > 1):
        for kind in ("state", "param_groups"):
            have = next((f for f in fqns if any(k.startswith(f"{kind}.{f}.") for k in osd)), None)
            if have is None:
                continue
            for key in [k for k in osd if k.startswith(f"{kind}.{have}.")]:
                for other in fqns:
                    out.setdefault(f"{kind}.{other}.{key[len(kind) + len(have) + 2:]}", osd[key])
    return out


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(Path(folder) / name, "rb+") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restores_rng(saved: dict, world: int, layout: dict | None) -> bool:
    """Whether each rank gets back the RNG stream the rank of its number saved: only when
    the world size and every parallel degree (`layout`, as the saver recorded it) are
    unchanged. Streams encode the layout: tensor-parallel ranks hold equal streams (they
    must draw the same dropout masks on replicated activations) and data-parallel ranks
    different ones, so under another layout of the same size rank numbers pair the wrong
    streams (zero3 x2 -> tp2 would give one tp group two streams, and its ranks would drift
    apart with dropout > 0). Otherwise the ranks keep the streams a fresh run of their
    layout starts with."""
    return saved.get("world_size") == world and saved.get("layout") == layout


def save_sharded(run_dir: Path, step: int, parts: list[nn.Module], optimizers: list[Optimizer],
                 state: dict, keep: int = 2, layout: dict | None = None) -> Path:
    """Write this rank's shards of `parts` and `optimizers` for `step`; all ranks call it.
    `layout` (the parallel degrees) is recorded for `restores_rng`. Returns the final
    folder; all but the newest `keep` checkpoints are then removed."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if _rank() == 0:
        if tmp.exists():  # left by a crash in an earlier save of this step
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    to_save, _, _ = _collect(parts, optimizers, aliases=True)
    with _quiet_single_process():
        dcp.save(to_save, checkpoint_id=str(tmp))
    rng_file = tmp / "rng" / f"rank_{_rank():05d}.pt"
    torch.save(rng_state(), rng_file)
    with open(rng_file, "rb+") as handle:
        os.fsync(handle.fileno())
    _barrier()  # every rank's files are complete before rank 0 publishes the folder
    if _rank() == 0:
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / LAYOUT_FILE).write_text(json.dumps({"world_size": _world(), "layout": layout}))
        _fsync_tree(tmp)
        if final.exists():  # the same step saved twice (a final save right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()  # nobody reads or rewrites the folder before it has its final name
    return final


def load_sharded(path: Path, parts: list[nn.Module], optimizers: list[Optimizer] | None,
                 layout: dict | None = None) -> dict:
    """Fill `parts` (and `optimizers`, and this rank's RNG when `layout` is the saver's, see
    `restores_rng`) from a sharded checkpoint written under any layout, or from a
    one-process checkpoint; all ranks call it. Works without a process group too (one
    process, a plain Transformer and its AdamW). Returns `state`."""
    path = Path(path)
    if not is_sharded(path):
        if (path / "model.safetensors").is_file() and (path / "optimizer.pt").is_file():
            return _load_single_process_checkpoint(path, parts, optimizers)
        raise FileNotFoundError(f"{path} is not a checkpoint (no {LAYOUT_FILE}, no model.safetensors).")
    # Fresh optimizers get zero states here, shaped and placed like the parameters, so
    # DCP has a destination for every shard.
    to_load, model_keys, optim_keys = _collect(parts, optimizers)
    try:
        with _quiet_single_process():
            dcp.load(to_load, checkpoint_id=str(path))
    except dcp.CheckpointException as err:  # raised on every rank alike
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ConfigError(f"{path} does not hold the state of this model ({lines[-1] if lines else 'unreadable'}); "
                          "resume with the model settings the run was saved with.") from None
    for i, part in enumerate(parts):
        set_model_state_dict(part, {k: to_load["model"][k] for k in model_keys[i]})
        if optimizers is not None:
            how = [{k: group[k] for k in _IMPLEMENTATION if k in group} for group in optimizers[i].param_groups]
            set_optimizer_state_dict(part, optimizers[i], {k: to_load["optim"][k] for k in optim_keys[i]},
                                     options=_OPTIM)
            for group, kept in zip(optimizers[i].param_groups, how):
                group.update(kept)
    saved = json.loads((path / LAYOUT_FILE).read_text())
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if optimizers is not None and restores_rng(saved, _world(), layout) and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / "state.json").read_text())


def _load_single_process_checkpoint(path: Path, parts: list[nn.Module], optimizers: list[Optimizer] | None) -> dict:
    """A checkpoint of `train/checkpoint.py` into any layout: every rank reads the whole
    files and keeps its own pieces (a run started on one device, resumed on many)."""
    from safetensors import safe_open

    from ember.config import load_config
    from ember.model.transformer import Transformer
    from ember.train.setup import build_optimizer

    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        model = {k: handle.get_tensor(k) for k in handle.keys()}
        tied = {k: v for k, v in (handle.metadata() or {}).items() if v in model}  # stored once
    model.update({removed: model[kept] for removed, kept in tied.items()})
    flat: dict[str, Any] = {}
    if optimizers is not None:
        # optimizer.pt numbers parameters in the order the one-process trainer gave them to
        # its optimizer; rebuild that order on a weightless copy of the run's model.
        cfg = load_config(path.parent.parent / "config.toml")
        with torch.device("meta"):
            shadow = Transformer(cfg.model)
        names = {id(p): n for n, p in shadow.named_parameters()}
        order = [names[id(p)] for group in build_optimizer(shadow, cfg.optim, torch.device("cpu")).param_groups
                 for p in group["params"]]
        saved = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        for group in saved["param_groups"]:
            for index in group["params"]:
                fqns = [order[index]] + [r for r, kept in tied.items() if kept == order[index]]
                for fqn in fqns:
                    flat.update({f"state.{fqn}.{k}": v for k, v in saved["state"].get(index, {}).items()})
                    flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    for i, part in enumerate(parts):
        set_model_state_dict(part, {k: _shard_like(_pick(model, k, v, path), v)
                                    for k, v in get_model_state_dict(part).items()})
        if optimizers is not None:
            how = [{k: group[k] for k in _IMPLEMENTATION if k in group} for group in optimizers[i].param_groups]
            wanted = get_optimizer_state_dict(part, optimizers[i], options=_OPTIM)
            set_optimizer_state_dict(part, optimizers[i],
                                     {k: _shard_like(_pick(flat, k, v, path), v) for k, v in wanted.items()},
                                     options=_OPTIM)
            for group, kept in zip(optimizers[i].param_groups, how):
                group.update(kept)
    if optimizers is not None and _world() == 1:
        set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return json.loads((path / "state.json").read_text())


def _pick(saved: dict[str, Any], key: str, like: Any, path: Path) -> Any:
    if key not in saved:
        raise ConfigError(f"{path} holds no {key}, which this model has; "
                          "resume with the model settings the run was saved with.")
    found = saved[key]
    if isinstance(like, torch.Tensor) and tuple(found.shape) != tuple(like.shape):
        raise ConfigError(f"{path} holds {key} of shape {tuple(found.shape)} where this model has "
                          f"{tuple(like.shape)}; resume with the model settings the run was saved with.")
    return found


def _shard_like(whole: Any, like: Any) -> Any:
    """`whole` (a full tensor, or a number) cut and placed as `like` is (a DTensor's shard on
    its mesh, or a plain tensor on its device)."""
    if not isinstance(like, torch.Tensor):
        return whole
    whole = whole.to(device=like.device, dtype=like.dtype)
    mesh = getattr(like, "device_mesh", None)
    if mesh is None:
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, mesh, like.placements)


def _full_tensor(value: Any) -> Any:
    full = getattr(value, "full_tensor", None)  # a DTensor: gather its shards (a collective)
    tensor = full() if full is not None else value
    return tensor.detach().to("cpu") if isinstance(tensor, torch.Tensor) else tensor


def save_full_model(parts: list[nn.Module], path: Path) -> None:
    """Write the whole model as one `model.safetensors` (the format `ember eval` and
    `ember export` read), gathering shards and pipeline stages to rank 0; all ranks call it."""
    local: dict[str, Any] = {}
    for part in parts:
        local.update(get_model_state_dict(part))
    names = sorted(local)
    owners: list[list[str]] = [names]
    if _world() > 1:
        owners = [None] * _world()  # type: ignore[list-item]
        dist.all_gather_object(owners, names)
    # Each name is sent by the lowest rank holding it; the others only take part in the
    # gathers (in the same order on every rank of a mesh) and drop the result at once.
    claimed = set().union(*owners[: _rank()]) if _rank() > 0 else set()
    mine: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = _full_tensor(local[name])
        if name not in claimed:
            mine[name] = tensor
    if _world() > 1:
        gathered: list[Any] = [None] * _world() if _rank() == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, gathered, dst=0)
        if _rank() == 0:
            mine = {k: v for sent in gathered for k, v in sent.items()}
    if _rank() == 0:
        _write_safetensors(mine, Path(path))
    _barrier()


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    # Stages on different ranks hold tied embedding and head as two equal copies; the plain
    # model holds one tensor, so store it once as `save_model` does or load_model refuses it.
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
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
