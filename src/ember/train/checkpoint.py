"""Checkpoints: one format for one process and for any layout under torchrun, never
half-written, never unpickling arbitrary objects.

A checkpoint is a folder `RUN_DIR/checkpoints/step_00000123/` holding:

- the `torch.distributed.checkpoint` files (`.metadata` and one `*.distcp` per writing
  rank): model parameters under `model.<FQN>` and AdamW states under
  `optim.state.<FQN>.<name>` / `optim.param_groups.<FQN>.<name>`, where FQN is the plain
  Transformer's parameter name ("blocks.3.attn.q_proj.weight"). Wrappers (DDP, FSDP2,
  compile, activation checkpointing) are stripped and DTensor shards (FSDP, tensor
  parallel) are stored as pieces of the whole tensor, so the keys and shapes do not
  depend on the layout that wrote them and any other layout, one process included,
  re-slices them on load;
- `rng/rank_NNNNN.pt`, each rank's torch RNG state (tensors only, loaded with
  `weights_only=True`), restored only when the loading layout is the saving one
  (`restores_rng`);
- `sharded.json` (world size and parallel degrees at save time) and `state.json`
  (progress and data position: the `state` the trainer passes), written by rank 0;
- `checksums.json`, the sha256 of every other file, checked before a load (`checksums.py`);
  `sharded.json` records that it was written ("checksummed"), so a folder without it is damaged.

Every rank writes into `step_N.tmp/`; after a barrier rank 0 flushes and renames it, so
a crash at any moment leaves the newest complete checkpoint loadable. `Checkpointer`
does the same in the background (`train.checkpoint_async`). The whole model for
evaluation and export is `RUN_DIR/model.safetensors` (`train/model_file.py`).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
import warnings
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from ember.atomic import publish_dir
from ember.config import ConfigError
from ember.train import checksums

PREFIX = "step_"
LAYOUT_FILE = "sharded.json"  # its name from when only torchrun runs wrote this format
# Per-FQN optimizer keys (instead of integer parameter ids) are what let one optimizer per
# pipeline part be merged with, and split back into, any other set of parts.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
# How this process runs the update (kernels for its device), not training state: a
# checkpoint from GPUs must not switch a CPU run to fused kernels, or back.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    # DCP warns that it assumes one process when there is no process group: that is the
    # intended use here (one process saving or loading), not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and "." not in p.name]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


def step_of(path: Path) -> int:
    return int(Path(path).name[len(PREFIX):])


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def set_aside(run_dir: Path, from_step: int) -> None:
    """Rank 0: checkpoints of `from_step` and later hold weights a loss spike had already
    reached (a checkpoint can be due between a spike and the logged step that catches it).
    They are renamed NAME.after-spike, which --resume and pruning pass over, and kept for a
    look."""
    if rank() != 0:
        return
    for path in list_checkpoints(run_dir):
        if step_of(path) >= from_step:
            target, n = path.with_name(path.name + ".after-spike"), 1
            while target.exists():  # a second spike over the same steps
                target, n = path.with_name(f"{path.name}.after-spike{n}"), n + 1
            path.rename(target)


def remove_unfinished(run_dir: Path, run_files: Iterable[str]) -> None:
    """Rank 0, before a run (re)starts: checkpoints and run files (`run_files`) a killed save
    left under their temporary names. Nothing reads them, and a checkpoint's can be as large
    as the model. Only ember's own names: anything else is a user's, or another command's."""
    run_dir = Path(run_dir)
    for leftover in [*run_dir.glob(f"checkpoints/{PREFIX}*.tmp"), *(run_dir / f"{n}.tmp" for n in run_files)]:
        if not leftover.exists():
            continue
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / LAYOUT_FILE).is_file()


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restores_rng(saved: dict, world_size: int, layout: dict | None) -> bool:
    """Whether each rank gets back the RNG stream the rank of its number saved: only when
    the world size and every parallel degree (`layout`, as the saver recorded it) are
    unchanged. Streams encode the layout: tensor-parallel ranks hold equal streams (they
    must draw the same dropout masks on replicated activations) and data-parallel ranks
    different ones, so under another layout of the same size rank numbers pair the wrong
    streams (zero3 x2 -> tp2 would give one tp group two streams, and its ranks would drift
    apart with dropout > 0). Otherwise the ranks keep the streams a fresh run of their
    layout starts with."""
    return saved.get("world_size") == world_size and saved.get("layout") == layout


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
    names: dict[int, list[str]] = {}
    for name, param in part.named_parameters(remove_duplicate=False):
        # _get_fqns strips wrapper prefixes exactly as get_model_state_dict does.
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


def _prepare(run_dir: Path, step: int, state: dict, layout: dict | None) -> tuple[Path, Path]:
    """The temporary and final folders of `step`'s checkpoint, the temporary one made with
    this rank's RNG state and (rank 0) the small files in it."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if rank() == 0:
        if tmp.exists():  # left by a crash in an earlier save of this step
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / LAYOUT_FILE).write_text(json.dumps({"world_size": world(), "layout": layout, "checksummed": True}))
    barrier()
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank():05d}.pt")
    return tmp, final


def _publish(run_dir: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rank 0, once every rank's files are complete: the folder gets its final name, and
    all but the newest `keep` checkpoints go."""
    if rank() == 0:
        if final.exists():  # this step saved before holds this state: it stays, never removed before a copy is in place
            shutil.rmtree(tmp)
        else:
            publish_dir(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def save(run_dir: Path, step: int, parts: list[nn.Module], optimizers: list[Optimizer], state: dict,
         keep: int = 2, layout: dict | None = None) -> Path:
    """Write this rank's shards of `parts` and `optimizers` for `step`; every rank calls it.
    `layout` (the parallel degrees) is recorded for `restores_rng`. Returns the final
    folder; all but the newest `keep` checkpoints are then removed."""
    tmp, final = _prepare(run_dir, step, state, layout)
    to_save, _, _ = _collect(parts, optimizers, aliases=True)
    with _quiet_single_process():
        dcp.save(to_save, checkpoint_id=str(tmp))
    barrier()  # every rank's files are complete before they are hashed and published
    checksums.write(tmp)
    _publish(run_dir, tmp, final, keep)
    barrier()  # nobody reads or rewrites the folder before it has its final name
    return final


class Checkpointer:
    """Saves checkpoints, in the background when `asynchronous`: the state is copied to
    host memory during the call (so later steps cannot change what is written), then
    written by a thread while training goes on, and the folder published (renamed into
    place, old ones pruned) only once every rank's files are complete. At most one save is
    in flight; `wait()` ends it, and must run on every rank at the same points (before
    the next save, before loading a checkpoint, before the run returns). Every rank
    builds its Checkpointer at the same point: the writer's collectives get a process
    group of their own, so they never interleave with the training step's."""

    def __init__(self, asynchronous: bool):
        self.asynchronous = asynchronous
        self.group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        if asynchronous and not dist.is_initialized():
            # _quiet_single_process for the writer's thread, which outlives any with-block.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ember-checkpoint") if asynchronous else None
        self.pending: Future | None = None

    def save(self, run_dir: Path, step: int, parts: list[nn.Module], optimizers: list[Optimizer], state: dict,
             keep: int = 2, layout: dict | None = None) -> Path:
        self.wait()
        if not self.asynchronous:
            return save(run_dir, step, parts, optimizers, state, keep, layout)
        tmp, final = _prepare(run_dir, step, state, layout)
        to_save, _, _ = _collect(parts, optimizers, aliases=True)
        with _quiet_single_process():
            written = dcp.async_save(to_save, checkpoint_id=str(tmp), process_group=self.group)

        def finish() -> None:
            written.result()  # returns once every rank's shards are written (DCP gathers their results)
            checksums.write(tmp, self.group)
            _publish(run_dir, tmp, final, keep)

        self.pending = self.pool.submit(finish)
        return final

    def wait(self) -> None:
        """Block until the save in flight is written and published, on every rank."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()
        barrier()  # rank 0 has published: every rank sees the new checkpoint from here on

    def close(self) -> None:
        self.wait()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def load(path: Path, parts: list[nn.Module], optimizers: list[Optimizer] | None = None,
         layout: dict | None = None) -> dict:
    """Fill `parts` (and `optimizers`, and this rank's RNG when `layout` is the saver's) from
    a checkpoint written under any layout; every rank calls it. Works without a process
    group (one process). Returns the saved `state`. With `optimizers` the load continues a
    run, and a damaged checkpoint is met with how --resume passes over it; without, the
    weights are read for evaluation or export."""
    path = Path(path)
    resuming = optimizers is not None
    if not is_checkpoint(path):
        if (path / "optimizer.pt").is_file():
            raise ConfigError(f"{path} was written by an older ember in a format this one cannot resume; "
                              "its model.safetensors still evaluates and exports, or start a new run.")
        raise ConfigError(f"{path} is not an ember checkpoint (it has no {LAYOUT_FILE}).")
    saved = _read_json(path / LAYOUT_FILE, resuming)
    # Only checkpoints from before checksums.json existed lack it by design.
    listed = not isinstance(saved, dict) or saved.get("checksummed", False)
    damaged = checksums.first_damaged(path, listed)
    if damaged is not None:
        raise ConfigError(f"{path / damaged} is missing or does not match its checksum: the checkpoint is damaged; "
                          f"{_what_next(path, resuming)}.")
    # Fresh optimizers get zero states here, shaped and placed like the parameters, so
    # DCP has a destination for every shard.
    to_load, model_keys, optim_keys = _collect(parts, optimizers)
    try:
        with _quiet_single_process():
            dcp.load(to_load, checkpoint_id=str(path))
    except dcp.CheckpointException as err:  # raised on every rank alike
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        cause = ("resume with the model settings the run was saved with, or, if they are those, the checkpoint "
                 "is damaged:" if resuming else "the run's config.toml was changed, or the checkpoint is damaged;")
        raise ConfigError(f"{path} cannot be loaded into this model ({lines[-1] if lines else 'unreadable'}): "
                          f"{cause} {_what_next(path, resuming)}.") from None
    for i, part in enumerate(parts):
        set_model_state_dict(part, {k: to_load["model"][k] for k in model_keys[i]})
        if optimizers is not None:
            how = [{k: group[k] for k in _IMPLEMENTATION if k in group} for group in optimizers[i].param_groups]
            set_optimizer_state_dict(part, optimizers[i], {k: to_load["optim"][k] for k in optim_keys[i]},
                                     options=_OPTIM)
            for group, kept in zip(optimizers[i].param_groups, how):
                group.update(kept)
    rng_file = path / "rng" / f"rank_{rank():05d}.pt"
    if optimizers is not None and restores_rng(saved, world(), layout):
        if not rng_file.is_file():  # without it the run's dropout and masking would draw other numbers
            raise ConfigError(f"{path} lacks {rng_file.relative_to(path)}, so the run cannot continue exactly; "
                              f"{_what_next(path, resuming)}.")
        set_rng_state(torch.load(rng_file, weights_only=True))
    return read_state(path, resuming)


def read_state(path: Path, resuming: bool = True) -> dict:
    """A checkpoint's `state.json`: the trainer's progress and data position."""
    return _read_json(Path(path) / "state.json", resuming)


def _read_json(file: Path, resuming: bool) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file} cannot be read ({type(err).__name__}): the checkpoint is damaged; "
                          f"{_what_next(file.parent, resuming)}.") from None


def _what_next(path: Path, resuming: bool) -> str:
    """What a user does about damaged checkpoint `path`. Renaming it is how --resume passes
    over it, which only a resume needs (and a resume only loads names without a suffix);
    evaluation and export read the folder named to them, which may be one set aside."""
    if not resuming:
        return "give --checkpoint another of the run's checkpoints"
    return f"rename it to {path.name}.damaged and --resume takes the one before it"
