"""Checkpoints that are never half-written and never unpickle arbitrary objects.

A checkpoint is a folder `RUN_DIR/checkpoints/step_00000123/` holding
`model.safetensors`, `optimizer.pt` (tensors and numbers only, loaded with
`weights_only=True`), `rng.pt` and `state.json` (progress, data position). It is written
under a `.tmp` name and renamed when complete, so the newest folder without that suffix
is always loadable, whenever the process dies.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write a complete checkpoint for `step`, then drop all but the newest `keep`."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb+") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # the same step saved twice (a final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and "." not in p.name]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore model (and optimizer, RNG) in place; return the saved state. A sharded
    checkpoint (written under torchrun) loads too, into this one process."""
    path = Path(path)
    from ember.train.dist_checkpoint import is_sharded, load_sharded  # it imports this module

    if is_sharded(path):
        return load_sharded(path, [model], [optimizer] if optimizer is not None else None)
    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
        set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return json.loads((path / "state.json").read_text())
