"""A parallel layout, and every rule it must obey, in one place for the trainer and the
planner alike.

`Layout` is the `[parallel]` section resolved for a world size (dp_shard=-1 becomes the
rest of the world), plus the micro-batch. `problems` returns everything wrong with a
layout for a model, a global batch and a world size, each as one sentence that says what
to change; `ember train`, `ember plan`, `ember tune` and `ember bench` all ask it, so a
rule added here holds everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ember.config import Config, ConfigError
from ember.cost import block_forward_flops_per_token, output_forward_flops_per_token

# schedule -> (several stages per rank, stage placement, class in torch.distributed.pipelining).
# "loop": rank r holds stages r, r + pp, ...; "v": rank r holds stages r and 2pp - 1 - r.
SCHEDULES: dict[str, tuple[bool, str, str]] = {
    "gpipe": (False, "loop", "ScheduleGPipe"),
    "1f1b": (False, "loop", "Schedule1F1B"),
    "interleaved": (True, "loop", "ScheduleInterleaved1F1B"),
    "zero_bubble": (True, "loop", "ScheduleInterleavedZeroBubble"),
    "zbv": (True, "v", "ScheduleZBVZeroBubble"),
}
ZERO_BUBBLE = ("zero_bubble", "zbv")  # they split backward in two, which compiled stages cannot
RECOMPUTE = ("none", "selective", "full")


def layout_keys() -> set[str]:
    """The config keys a layout sets (`Layout.settings`, and an uneven split), which `ember
    plan` and `ember tune` choose themselves: a `--set` of one would be overridden."""
    return (set(Layout().settings(1)) | {"parallel.stage_layers"}) - {"train.global_batch"}


@functools.cache
def available_schedules() -> tuple[str, ...]:
    # Imported here: torch.distributed.pipelining takes seconds to import, and `ember plan`
    # answers a mistake in its arguments before it needs it.
    from torch.distributed import pipelining

    return tuple(name for name, (_, _, cls) in SCHEDULES.items() if hasattr(pipelining, cls))


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    zero: int = 0
    sp: bool = False
    vpp: int = 1
    schedule: str = "1f1b"
    micro_batch: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    stage_layers: tuple[int, ...] = ()  # layers of each of the pp x vpp stages; () = balanced
    # Context parallelism: each sequence split over cp ranks that hold the same weights
    # (ring attention). Other frameworks' layouts only: ember's trainer runs cp = 1, and the
    # planner prices cp > 1 for the stacks that have it (plan/timing.py).
    cp: int = 1

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> "Layout":
        """The run's [parallel] section and micro-batch on `world` processes."""
        p = cfg.parallel
        rest = world // max(1, p.pp * p.dp_replicate * p.tp)
        shard = p.dp_shard if p.dp_shard != -1 else max(1, rest)
        return cls(tp=p.tp, pp=p.pp, dp_shard=shard, dp_replicate=p.dp_replicate, zero=p.zero, sp=p.sp,
                   vpp=p.vpp, schedule=p.schedule, micro_batch=cfg.train.micro_batch, recompute=p.recompute,
                   recompute_every=p.recompute_every, stage_layers=tuple(p.stage_layers))

    def settings(self, global_batch: int) -> dict[str, object]:
        """The config keys of this layout (`--set key=value` for `ember train`)."""
        keys = {f"parallel.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("micro_batch", "stage_layers", "cp")}
        keys["parallel.sp"] = str(self.sp).lower()
        if self.stage_layers:
            keys["parallel.stage_layers"] = "[" + ", ".join(map(str, self.stage_layers)) + "]"
        return keys | {"train.micro_batch": self.micro_batch, "train.global_batch": global_batch}

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards model states over and gradients are reduced over beyond the
        replicas: the dp_shard group, and with context parallelism its cp ranks, which hold
        the same weights (Megatron-LM's distributed optimizer and torchtitan's FSDP shard
        over both)."""
        return self.dp_shard * self.cp

    @property
    def sizes(self) -> dict[str, int]:
        """Device-mesh sizes by dim name."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each pipeline runs per step (the gradient-accumulation count)."""
        return global_batch // (self.dp * self.micro_batch)

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def split(self, model) -> tuple[int, ...]:
        """The layers of each pipeline stage, in model order: as given (`stage_layers`), equal
        when pp x vpp divides the layers, else balanced by cost (`balanced_split`)."""
        if self.stage_layers:
            return self.stage_layers
        if model.layers % self.stages == 0:
            return (model.layers // self.stages,) * self.stages
        return balanced_split(model, self.stages)

    def stage_owner(self) -> tuple[int, ...]:
        """The pipeline rank holding each stage. "loop" schedules: rank r holds stages r,
        r + pp, ...; "v" (ZB-V): rank r holds stages r and 2pp - 1 - r."""
        return _stage_owner(SCHEDULES.get(self.schedule, (False, "loop"))[1] == "v", self.pp, self.stages)

    def rank_layers(self, model) -> tuple[int, ...]:
        """The layers each pipeline rank holds, over all its stages."""
        return _layers_by_rank(self.stage_owner(), self.split(model), self.pp)

    def recomputed_fraction(self, layers: int) -> float:
        """The share of the layers the policy covers: layers 0, k, 2k, ... as the trainer picks."""
        if self.recompute == "none":
            return 0.0
        return -(-layers // self.recompute_every) / layers

    def text(self) -> str:
        """The `ember plan --layout` form (the micro-batch is `mbs` there)."""
        parts = ([f"tp={self.tp}"] + (["sp=1"] if self.sp else []) + ([f"cp={self.cp}"] if self.cp > 1 else [])
                 + [f"pp={self.pp}"])
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.stage_layers:
            parts.append("stage_layers=" + "/".join(map(str, self.stage_layers)))
        parts.append(f"dp={self.dp}")
        if self.zero:
            parts.append(f"zero={self.zero}")
            if self.dp_replicate > 1:
                parts.append(f"dp_shard={self.dp_shard}")
        parts += [f"mbs={self.micro_batch}", f"recompute={self.recompute}"]
        if self.recompute != "none" and self.recompute_every > 1:
            parts.append(f"recompute_every={self.recompute_every}")
        return ",".join(parts)


def problems(layout: Layout, model, global_batch: int, world: int | None = None, *, batch_start: int = 0,
             seq_len: int | None = None, compile: bool = False, document_mask: bool = False,
             ember: bool = True, grad_dtype: str = "fp32", fp32: bool = False) -> list[str]:
    """Everything that keeps `layout` from training `model` (a ModelConfig or the planner's
    ModelSpec) at `global_batch` sequences per step on `world` processes (None: any), one
    sentence each. `ember=False` leaves out what only ember's trainer refuses, so the planner
    can price layouts other frameworks run. `fp32`: the run computes in fp32 (no autocast)."""
    lo, out = layout, []
    if world is not None and lo.gpus != world:
        names = ("pp", "dp_replicate", "dp_shard", "tp") + (("cp",) if lo.cp > 1 else ())
        sizes = " x ".join(str(getattr(lo, name)) for name in names)
        out.append(f"the layout {' x '.join(names)} = {sizes} = {lo.gpus} must equal the world size {world} "
                   "(the processes torchrun starts, or --gpus when planning)")
    if lo.cp > 1 and ember:
        out.append(f"context parallelism (cp={lo.cp}) is not something ember's trainer runs; split long sequences "
                   "with tensor and sequence parallelism, or price other software with --stack")
    if lo.cp > 1 and seq_len is not None and seq_len % (2 * lo.cp):
        out.append(f"context parallelism cuts each sequence into 2 x cp = {2 * lo.cp} chunks (two per rank, "
                   f"balancing causal attention), so the sequence length ({seq_len}) must be divisible by {2 * lo.cp}")
    rows = lo.dp * lo.micro_batch
    if global_batch % rows:
        out.append(f"train.global_batch ({global_batch}) must be a multiple of data-parallel ranks x "
                   f"train.micro_batch ({lo.dp} x {lo.micro_batch} = {rows})")
    if batch_start and batch_start % rows:
        out.append(f"schedule.batch_start ({batch_start}) must be a multiple of data-parallel ranks x "
                   f"train.micro_batch ({lo.dp} x {lo.micro_batch} = {rows}), so the ramp's steps fit every layout")
    if lo.zero > 0 and lo.shard_ranks == 1:
        out.append(f"parallel.zero={lo.zero} shards model states over parallel.dp_shard ranks, and dp_shard is 1, "
                   f"so it would save nothing; use parallel.zero=0 or a dp_shard above 1")
    if ember and lo.zero == 0 and lo.dp > 1 and (lo.tp > 1 or lo.pp > 1):
        # DDP takes neither DTensor parameters nor several forwards before a backward.
        sharded = "" if lo.dp_shard > 1 else (f", with those {lo.dp} ranks in parallel.dp_shard (dp_replicate=1), "
                                              "since FSDP shards over dp_shard")
        out.append("data parallelism combined with tensor or pipeline parallelism goes through FSDP2, not DDP; set "
                   "parallel.zero=1 (or 2, 3) when parallel.tp or parallel.pp is above 1 with several "
                   f"data-parallel ranks{sharded}")
    if grad_dtype == "bf16" and fp32 and lo.dp > 1:
        # Rounding summed gradients to bf16 would undo what fp32 compute is chosen for (the
        # planner prices fp32 runs with fp32 gradients too).
        out.append("parallel.grad_dtype=bf16 reduces gradients in bf16, which suits bf16 compute, but this run "
                   "computes in fp32 (train.precision=fp32, or auto on a CPU); set train.precision=bf16 or "
                   "parallel.grad_dtype=fp32")
    if lo.recompute not in RECOMPUTE:
        out.append(f"parallel.recompute must be one of {', '.join(RECOMPUTE)}, not {lo.recompute!r}")
    out += _tensor_problems(lo, model)
    if lo.sp and lo.tp > 1 and seq_len is not None and seq_len % lo.tp:
        out.append(f"sequence parallelism splits each sequence over the tensor-parallel ranks, so the data's "
                   f"sequence length ({seq_len}) must be divisible by parallel.tp ({lo.tp})")
    out += _pipeline_problems(lo, model, global_batch, batch_start, compile, ember)
    if lo.pp > 1 and document_mask:
        # Later stages receive only the previous stage's activations, never the document ids.
        out.append("data.document_mask=true is not supported with pipeline parallelism (parallel.pp > 1): later "
                   "stages never see the document ids; use data or tensor parallelism instead")
    return out


def _tensor_problems(lo: Layout, model) -> list[str]:
    if lo.sp and lo.tp == 1:
        return ["parallel.sp (sequence parallel) splits the work of tensor parallelism, so it needs parallel.tp > 1"]
    if lo.tp == 1:
        return []
    out = []
    kv_heads = getattr(model, "kv_heads", 0) or model.heads
    if model.heads % lo.tp:
        out.append(f"model.heads ({model.heads}) must be divisible by parallel.tp ({lo.tp}): each "
                   "tensor-parallel rank computes whole attention heads")
    elif kv_heads % lo.tp:
        out.append(f"model.kv_heads ({kv_heads}) must be divisible by parallel.tp ({lo.tp}): each "
                   "tensor-parallel rank holds whole key/value heads")
    for name in ("hidden", "mlp_hidden"):
        if getattr(model, name) % lo.tp:
            out.append(f"model.{name} ({getattr(model, name)}) must be divisible by parallel.tp ({lo.tp})")
    multiple = model.vocab_multiple
    if model.vocab_size <= 0 and multiple % lo.tp:  # not known yet: only a multiple of tp is sure to split
        out.append(f"model.vocab_multiple ({multiple}) must be a multiple of parallel.tp ({lo.tp}): the vocabulary "
                   f"is padded up to a multiple of it and split over the tensor-parallel ranks")
    padded = -(-model.vocab_size // multiple) * multiple
    if model.vocab_size > 0 and padded % lo.tp:
        out.append(f"the padded vocabulary ({padded}) must be divisible by parallel.tp ({lo.tp}) to split the "
                   f"embedding and output layer; set model.vocab_multiple (now {multiple}) to a multiple of {lo.tp}")
    return out


def _pipeline_problems(lo: Layout, model, global_batch: int, batch_start: int, compile: bool,
                       ember: bool) -> list[str]:
    if lo.schedule not in SCHEDULES:
        return [f"parallel.schedule={lo.schedule!r} is not one of {', '.join(SCHEDULES)}"]
    multi = SCHEDULES[lo.schedule][0]
    out = []
    if lo.vpp > 1 and lo.pp == 1:  # zbv's vpp of 2 is its own, not one the user gave
        name = f"parallel.schedule={lo.schedule!r}" if lo.schedule == "zbv" else "parallel.vpp > 1"
        out.append(f"{name} splits each pipeline rank into {lo.vpp} stages, so it needs parallel.pp > 1")
    if lo.stage_layers and lo.pp == 1:
        out.append("parallel.stage_layers splits the layers over pipeline stages, so it needs parallel.pp > 1")
    if lo.pp == 1:
        return out
    if lo.schedule not in available_schedules():
        out.append(f"parallel.schedule={lo.schedule!r} is not in this PyTorch; choose one of "
                   f"{', '.join(available_schedules())}")
    if lo.vpp > 1 and not multi:
        out.append(f"parallel.vpp={lo.vpp} (virtual stages) needs parallel.schedule=interleaved (or a zero-bubble "
                   f"schedule), not {lo.schedule!r}")
    if multi and lo.vpp < 2:
        out.append(f"parallel.schedule={lo.schedule!r} runs several stages per rank, so it needs parallel.vpp >= 2")
    if lo.schedule == "zbv" and lo.vpp != 2:
        out.append(f"parallel.schedule='zbv' places exactly two stages per rank; set parallel.vpp=2 (got {lo.vpp})")
    if lo.stage_layers:
        given = lo.stage_layers
        if len(given) != lo.stages or sum(given) != model.layers or min(given) < 1:
            out.append(f"parallel.stage_layers ({list(given)}) must give each of the parallel.pp x parallel.vpp = "
                       f"{lo.stages} stages at least one layer, {model.layers} (model.layers) in all")
    elif model.layers < lo.stages:
        out.append(f"model.layers ({model.layers}) must be at least parallel.pp x parallel.vpp "
                   f"({lo.pp} x {lo.vpp} = {lo.stages}): every stage holds at least one layer")
    if ember and lo.schedule in ZERO_BUBBLE and lo.recompute != "none":
        # Measured on one block: its forward ran once in I and once per weight group in W
        # (six times) under full recomputation; selective recomputation raises in W.
        out.append(f"parallel.schedule={lo.schedule!r} splits each backward into input and weight gradients, and "
                   f"PyTorch reruns a recomputed block's forward for each of its weight groups in the second "
                   f"(selective recomputation cannot run twice at all); set parallel.recompute=none or use "
                   f"schedule 'interleaved'")
    if compile and lo.schedule in ZERO_BUBBLE:
        out.append(f"parallel.schedule={lo.schedule!r} cannot run compiled stages (PyTorch splits their backward "
                   f"into input and weight gradients); set train.compile=false or use schedule 'interleaved'")
    rows = lo.dp * lo.micro_batch
    for batch in sorted({global_batch, batch_start or global_batch}):
        if batch % rows == 0:
            out += micro_batch_problems(batch // rows, lo.pp, lo.schedule, ember)
    return out


def balanced_split(model, stages: int) -> tuple[int, ...]:
    """Whole layers per stage, in model order, so that the slowest stage is as fast as it can
    be: a block costs its forward FLOPs per token (`ember.cost`), the last stage also pays for
    the output layer (on the tokens it predicts), so it takes fewer blocks. The embedding is
    a lookup, not a matmul, and costs the first stage nothing."""
    block = block_forward_flops_per_token(model, getattr(model, "max_seq_len", 0))
    head = output_forward_flops_per_token(model, getattr(model, "predicted_fraction", 1.0))
    return _balanced(model.layers, stages, block, head)


@functools.lru_cache(maxsize=1024)
def _balanced(layers: int, stages: int, block: float, head: float) -> tuple[int, ...]:
    # Blocks are identical, so handing each next block to the stage it leaves cheapest
    # minimises the slowest stage; ties go to the earlier stage.
    counts = [1] * stages
    extra = [0.0] * (stages - 1) + [head]
    for _ in range(layers - stages):
        s = min(range(stages), key=lambda i: ((counts[i] + 1) * block + extra[i], i))
        counts[s] += 1
    return tuple(counts)


def micro_batch_problems(micro_batches: int, pp: int, schedule: str, ember: bool = True) -> list[str]:
    """The micro-batches of one step must fill the pipeline: the multi-stage schedules need a
    multiple of pp of them, and PyTorch's 1F1B, interleaved and zero-bubble schedules at
    least pp (Megatron-LM runs 1F1B with fewer)."""
    if schedule == "gpipe" or pp == 1:
        return []
    if micro_batches < pp and (ember or SCHEDULES[schedule][0]):
        return [f"parallel.schedule={schedule!r} needs at least parallel.pp={pp} micro-batches per step and "
                f"data-parallel rank, got {micro_batches}; raise train.global_batch or lower train.micro_batch "
                f"(or use schedule 'gpipe')"]
    if SCHEDULES[schedule][0] and micro_batches % pp:
        return [f"parallel.schedule={schedule!r} needs the micro-batches per step and data-parallel rank "
                f"({micro_batches}) to be a multiple of parallel.pp={pp}; change train.global_batch or "
                f"train.micro_batch"]
    return []


def check(layout: Layout, model, global_batch: int, world: int | None = None, **options) -> None:
    """Raise ConfigError with the first of `problems`, as one sentence."""
    found = problems(layout, model, global_batch, world, **options)
    if found:
        raise ConfigError(found[0] + ".")


def fuses_projections(p) -> bool:
    """Whether the trainer runs q/k/v and gate/up as one matmul each (model/fused.py) for
    the layout `p` (a Layout or parallel config): not under tensor parallelism, whose plan's
    hooks and DTensor weights are each projection's own, nor under a zero-bubble schedule,
    which asks a layer for its input and weight gradients in two passes that one fused
    autograd function cannot tell apart."""
    return p.tp == 1 and not (p.pp > 1 and p.schedule in ZERO_BUBBLE)


def compiles(cfg: Config, device_type: str) -> bool:
    """Whether the run compiles its blocks: train.compile, with "auto" meaning on CUDA
    unless the pipeline schedule is a zero-bubble one (its stages cannot be compiled)."""
    if cfg.train.compile != "auto":
        return cfg.train.compile == "true"
    return device_type == "cuda" and not (cfg.parallel.pp > 1 and cfg.parallel.schedule in ZERO_BUBBLE)


def run_problems(layout: Layout, cfg: Config, world: int, seq_len: int | None = None,
                 device_type: str | None = None) -> list[str]:
    """`problems` of `layout` for the run `cfg` describes (its model, batch, ramp, compile,
    document mask and gradient dtype) on `world` processes of sequences of `seq_len` tokens,
    on devices of `device_type` (None: not known yet, so precision "auto" is not judged)."""
    precision = cfg.train.precision
    fp32 = precision == "fp32" or (precision == "auto" and device_type not in (None, "cuda"))
    out = []
    if cfg.data.document_mask and cfg.model.document_kernel == "flex" and device_type not in (None, "cuda"):
        out.append(f"model.document_kernel=flex trains on CUDA only (PyTorch has no FlexAttention backward on "
                   f"{device_type}); set model.document_kernel=auto or sdpa")
    return out + problems(layout, cfg.model, cfg.train.global_batch, world, batch_start=cfg.schedule.batch_start,
                    seq_len=seq_len, compile=cfg.train.compile == "true", document_mask=cfg.data.document_mask,
                    grad_dtype=cfg.parallel.grad_dtype, fp32=fp32)


def check_run(cfg: Config, world: int, seq_len: int | None = None, device_type: str | None = None) -> Layout:
    """The run's layout on `world` processes, refused in one sentence if it cannot train."""
    p = cfg.parallel
    fixed = p.pp * p.dp_replicate * p.tp
    if p.dp_shard == -1 and world % fixed:
        raise ConfigError(
            f"parallel.pp x dp_replicate x tp = {p.pp} x {p.dp_replicate} x {p.tp} = {fixed} does not divide "
            f"the world size {world}, so parallel.dp_shard=-1 cannot take the rest; change the degrees or the "
            f"number of processes.")
    layout = Layout.from_config(cfg, world)
    found = run_problems(layout, cfg, world, seq_len, device_type)
    if found:
        raise ConfigError(found[0] + ".")
    return layout


# The planner asks these of each layout many times (every pipeline rank's memory and work, for
# thousands of layouts in a search); both are pure, so each is worked out once.
@functools.lru_cache(maxsize=1024)
def _stage_owner(v_shape: bool, pp: int, stages: int) -> tuple[int, ...]:
    if v_shape:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
    return tuple(s % pp for s in range(stages))


@functools.lru_cache(maxsize=4096)
def _layers_by_rank(owners: tuple[int, ...], split: tuple[int, ...], pp: int) -> tuple[int, ...]:
    out = [0] * pp
    for owner, layers in zip(owners, split):
        out[owner] += layers
    return tuple(out)
