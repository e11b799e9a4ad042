"""Every check of a layout against the world size, the model and the batch, in one place,
run before a process group, a model or a batch exists. Each refusal is one sentence that
says what to change (docs/parallel.md lists them)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

from ember.config import Config, ConfigError
from ember.parallel.mesh import resolve_sizes


def optional_module(name: str):
    """`ember.parallel.<name>` if this build has it, else None."""
    full = f"ember.parallel.{name}"
    if importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


def check_layout(cfg: Config, world: int) -> dict[str, int]:
    """Refuse a layout that cannot run on `world` processes; return the mesh sizes."""
    p, t = cfg.parallel, cfg.train
    fixed = p.pp * p.dp_replicate * p.tp
    if p.dp_shard == -1 and world % fixed:
        raise ConfigError(
            f"parallel.pp x dp_replicate x tp = {p.pp} x {p.dp_replicate} x {p.tp} = {fixed} does not divide "
            f"the world size {world}, so parallel.dp_shard=-1 cannot take the rest; change the degrees or the "
            f"number of processes.")
    sizes = resolve_sizes(p, world)
    product = sizes["pp"] * sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"]
    if product != world:
        raise ConfigError(
            f"the layout pp x dp_replicate x dp_shard x tp = {sizes['pp']} x {sizes['dp_replicate']} x "
            f"{sizes['dp_shard']} x {sizes['tp']} = {product} must equal the world size {world} "
            f"(processes started by torchrun).")
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    if t.global_batch % (dp * t.micro_batch):
        raise ConfigError(
            f"train.global_batch ({t.global_batch}) must be a multiple of data-parallel ranks x train.micro_batch "
            f"({dp} x {t.micro_batch} = {dp * t.micro_batch}).")
    s = cfg.schedule
    if s.batch_start and s.batch_start < dp * t.micro_batch:
        raise ConfigError(
            f"schedule.batch_start ({s.batch_start}) must be at least data-parallel ranks x train.micro_batch "
            f"({dp * t.micro_batch}), the smallest step every rank can share.")
    if p.zero > 0 and sizes["dp_shard"] == 1:
        raise ConfigError(
            f"parallel.zero={p.zero} shards model states over parallel.dp_shard ranks, and dp_shard is 1, so it "
            f"would save nothing; use parallel.zero=0 or a dp_shard above 1.")
    if p.zero == 0 and (p.tp > 1 or p.pp > 1) and dp > 1:
        # DDP takes neither DTensor parameters nor several forwards before a backward.
        raise ConfigError(
            "data parallelism combined with tensor or pipeline parallelism goes through FSDP2, not DDP; set "
            "parallel.zero=1 (or 2, 3) when parallel.tp or parallel.pp is above 1 with several data-parallel ranks.")
    if p.tp > 1:
        tensor = optional_module("tensor")
        if tensor is None:
            raise ConfigError("tensor parallelism (parallel.tp > 1) is not available in this build.")
        tensor.check_tensor_parallel(cfg.model, p.tp, p.sp)
    if p.pp > 1 and cfg.data.document_mask:
        # Stages after the first receive only the previous stage's activations, so the
        # document ids would have to travel through the schedules as a fake activation.
        raise ConfigError("data.document_mask=true is not supported with pipeline parallelism (parallel.pp > 1): "
                          "later stages never see the document ids; use data or tensor parallelism instead.")
    if p.pp > 1:
        pipeline = optional_module("pipeline")
        if pipeline is None:
            raise ConfigError("pipeline parallelism is not available in this build.")
        # Its optional checks: micro-batches per step and rank, and compiled stages.
        extra = {"micro_batches": t.global_batch // (dp * t.micro_batch), "compile": t.compile}
        accepted = inspect.signature(pipeline.check_pipeline).parameters
        pipeline.check_pipeline(cfg.model, p, **{k: v for k, v in extra.items() if k in accepted})
    return sizes


def check_world(world: int, resume: bool, sharded_checkpoints: bool) -> None:
    """What a multi-process run needs from the rest of this build."""
    if world > 1 and resume and not sharded_checkpoints:
        raise ConfigError("--resume with more than one process needs sharded checkpoints, which this build "
                          "does not have; resume the run in a single process.")
