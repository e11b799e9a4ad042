"""Where a run's checkpoints and final model go, for one process or many.

One process writes the local checkpoint format of `train/checkpoint.py` and loads either
kind. Many processes write sharded checkpoints through `ember.train.dist_checkpoint`
(all ranks take part, each writes its shards). A build without that module can still train
on many processes: replicated layouts (ZeRO-0, no tensor or pipeline parallelism) then
save the ordinary checkpoint from rank 0; the final model is gathered to rank 0 in every
layout; `--resume` is refused before the run starts (`ember.parallel.validate`).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.config import ConfigError
from ember.train import checkpoint as ckpt

if TYPE_CHECKING:
    from ember.train.trainer import Trainer


def _sharded():
    if importlib.util.find_spec("ember.train.dist_checkpoint") is None:
        return None
    return importlib.import_module("ember.train.dist_checkpoint")


def sharded_available() -> bool:
    return _sharded() is not None


def _replicated(trainer: "Trainer") -> bool:
    p = trainer.cfg.parallel
    return p.zero == 0 and p.tp == 1 and p.pp == 1


def layout_of(trainer: "Trainer") -> dict[str, int]:
    """The parallel degrees that decide which rank draws which random numbers; a sharded
    checkpoint restores RNG streams only into the same degrees (`restores_rng`)."""
    from ember.parallel.mesh import resolve_sizes

    p = trainer.cfg.parallel
    return {**resolve_sizes(p, trainer.topo.world), "vpp": p.vpp}


def save(trainer: "Trainer", step: int, state: dict[str, Any]) -> None:
    """A checkpoint of `step`; every rank calls it."""
    keep = trainer.cfg.train.keep_checkpoints
    engine, topo = trainer.engine, trainer.topo
    if topo.world == 1:
        ckpt.save_checkpoint(trainer.run_dir, step, engine.parts[0], engine.optimizers[0], state, keep=keep)
        return
    sharded = _sharded()
    if sharded is not None:
        sharded.save_sharded(trainer.run_dir, step, engine.parts, engine.optimizers, state, keep=keep,
                             layout=layout_of(trainer))
    elif _replicated(trainer):
        if topo.is_main:  # every rank holds the same weights and optimizer states
            ckpt.save_checkpoint(trainer.run_dir, step, engine.parts[0], engine.optimizers[0], state, keep=keep)
        topo.barrier()
    elif topo.is_main and not getattr(trainer, "_warned_no_checkpoint", False):
        trainer._warned_no_checkpoint = True
        warnings.warn("this build cannot checkpoint a sharded layout; the run keeps only its final model.",
                      stacklevel=2)


def load(trainer: "Trainer", path: Path) -> dict[str, Any]:
    """Restore the engine's parts and optimizers from either kind of checkpoint; returns
    the saved state (progress and data position)."""
    engine = trainer.engine
    sharded = _sharded()
    if sharded is not None and sharded.is_sharded(path):
        return sharded.load_sharded(path, engine.parts, engine.optimizers, layout=layout_of(trainer))
    if len(engine.parts) != 1 or trainer.topo.world > 1 and not _replicated(trainer):
        raise ConfigError("this checkpoint was written by one process; resume it in one process, or with "
                          "parallel.zero=0 and no tensor or pipeline parallelism.")
    return ckpt.load_checkpoint(path, engine.parts[0], engine.optimizers[0])


def save_model(trainer: "Trainer", path: Path) -> None:
    """The whole model as one safetensors file at `path`, written by rank 0 under a
    temporary name; every rank calls it."""
    from safetensors.torch import save_model as save_local

    engine, topo = trainer.engine, trainer.topo
    if topo.world == 1:
        tmp = path.with_name(path.name + ".tmp")
        save_local(engine.parts[0], str(tmp))
        tmp.replace(path)
        return
    sharded = _sharded()
    if sharded is not None:
        sharded.save_full_model(engine.parts, path)
        return
    _save_gathered(engine.parts[0], path, topo.is_main)
    topo.barrier()


def _save_gathered(module, path: Path, is_main: bool) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    # A tied head is the embedding's tensor: keep its first name, as a local save does.
    first: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            full.pop(name, None)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in full.items()}, str(tmp))
    tmp.replace(path)
