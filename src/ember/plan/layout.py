"""A parallel layout, the training shape it runs, how to read one from `--layout`, which
layouts are legal, and the space the search walks.

Layout keys (the same names the trainer's future [parallel] section will take):
  tp, sp            tensor parallelism and sequence parallelism (norms/dropout split by tp)
  pp, vpp, schedule pipeline stages, virtual stages per GPU, 1f1b / gpipe / interleaved
  dp                data-parallel size = dp_replicate x dp_shard
  zero              0 = replicate everything; 1 shards optimizer states, 2 also gradients,
                    3 also weights, each over dp_shard ranks (dp_shard defaults to dp)
  mbs               micro-batch size (sequences); gradient accumulation = global / (dp·mbs)
  recompute         activation checkpointing: none, selective (attention core) or full
  recompute_every   the policy covers every k-th layer only (1: all); the search keeps 1
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ember.config import ConfigError

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class TrainShape:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"  # bf16 or fp16: 2-byte activations and weights, the same peak

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


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
    mbs: int = 1
    recompute: str = "none"
    recompute_every: int = 1

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def recomputed_fraction(self, layers: int) -> float:
        """The share of the layers the policy covers: layers 0, k, 2k, ... as the trainer picks."""
        if self.recompute == "none":
            return 0.0
        return -(-layers // self.recompute_every) / layers

    def micro_batches(self, shape: TrainShape) -> int:
        """Micro-batches each pipeline runs per step (the gradient-accumulation count)."""
        return shape.global_batch // (self.dp * self.mbs)

    def text(self) -> str:
        parts = [f"tp={self.tp}"] + (["sp=1"] if self.sp else []) + [f"pp={self.pp}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        parts.append(f"dp={self.dp}")
        if self.zero:
            parts.append(f"zero={self.zero}")
            if self.dp_replicate > 1:
                parts.append(f"dp_shard={self.dp_shard}")
        parts += [f"mbs={self.mbs}", f"recompute={self.recompute}"]
        if self.recompute != "none" and self.recompute_every > 1:
            parts.append(f"recompute_every={self.recompute_every}")
        return ",".join(parts)

    def settings(self, shape: TrainShape) -> dict[str, object]:
        """The config keys this layout sets (`--set key=value` for `ember train`)."""
        return {"parallel.dp_replicate": self.dp_replicate, "parallel.dp_shard": self.dp_shard,
                "parallel.zero": self.zero, "parallel.tp": self.tp, "parallel.sp": str(self.sp).lower(),
                "parallel.pp": self.pp, "parallel.vpp": self.vpp, "parallel.schedule": self.schedule,
                "parallel.recompute": self.recompute, "parallel.recompute_every": self.recompute_every,
                "train.micro_batch": self.mbs,
                "train.global_batch": shape.global_batch}


_INT_KEYS = ("tp", "pp", "dp", "dp_shard", "dp_replicate", "zero", "vpp", "mbs", "recompute_every")
_KEYS = _INT_KEYS + ("sp", "schedule", "recompute")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def parse_layout(text: str, n_gpus: int) -> Layout:
    """'tp=8,pp=12,dp=4,zero=1,mbs=1,recompute=full' -> Layout; dp defaults to what is left."""
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in _KEYS or not value.strip():
            raise ConfigError(f"--layout item {item!r} is not key=value with a key among {', '.join(_KEYS)}.")
        values[key] = value.strip().lower()
    ints = {}
    for key in _INT_KEYS:
        if key in values:
            if not values[key].isdigit() or (int(values[key]) < 1 and key != "zero"):
                raise ConfigError(f"--layout {key} must be a positive whole number, not {values[key]!r}.")
            ints[key] = int(values[key])
    if values.get("sp", "0") not in _TRUE + _FALSE:
        raise ConfigError(f"--layout sp must be 0 or 1, not {values['sp']!r}.")
    for key, choices in (("schedule", SCHEDULES), ("recompute", RECOMPUTE)):
        if values.get(key, choices[0]) not in choices:
            raise ConfigError(f"--layout {key} must be one of {', '.join(choices)}, not {values[key]!r}.")
    tp, pp, vpp, zero = ints.get("tp", 1), ints.get("pp", 1), ints.get("vpp", 1), ints.get("zero", 0)
    if zero > 3:
        raise ConfigError(f"--layout zero must be 0, 1, 2 or 3, not {zero}.")
    if "dp" in ints:
        dp = ints["dp"]
    elif "dp_shard" in ints and "dp_replicate" in ints:
        dp = ints["dp_shard"] * ints["dp_replicate"]
    else:
        dp = max(1, n_gpus // (tp * pp))
    if zero:  # shard over every data-parallel rank unless told otherwise
        shard = ints.get("dp_shard", dp // ints.get("dp_replicate", 1))
    else:
        shard = ints.get("dp_shard", 1)
    replicate = ints.get("dp_replicate", dp // shard)
    if shard * replicate != dp:
        raise ConfigError(f"--layout dp ({dp}) must equal dp_shard x dp_replicate ({shard} x {replicate}).")
    if shard > 1 and not zero:
        raise ConfigError("--layout dp_shard > 1 shards state, which needs zero=1, 2 or 3.")
    schedule = values.get("schedule", "interleaved" if vpp > 1 else "1f1b")
    return Layout(tp=tp, pp=pp, dp_shard=shard, dp_replicate=replicate, zero=zero,
                  sp=values.get("sp", "0") in _TRUE and tp > 1, vpp=vpp, schedule=schedule,
                  mbs=ints.get("mbs", 1), recompute=values.get("recompute", "none"),
                  recompute_every=ints.get("recompute_every", 1))


def check(layout: Layout, model, n_gpus: int, shape: TrainShape) -> str | None:
    """Why `layout` cannot run `model` on `n_gpus` GPUs at `shape`, in one sentence; None if it can."""
    lo = layout
    if lo.gpus != n_gpus:
        return f"the layout uses tp x pp x dp = {lo.tp} x {lo.pp} x {lo.dp} = {lo.gpus} GPUs, not the {n_gpus} given"
    if model.heads % lo.tp or model.kv_heads % lo.tp:
        return (f"tp={lo.tp} must divide the {model.heads} attention heads"
                + (f" and the {model.kv_heads} key/value heads" if model.kv_heads != model.heads else ""))
    if lo.schedule == "interleaved" and (lo.vpp < 2 or lo.pp < 2):
        return "the interleaved schedule needs pp >= 2 and vpp >= 2"
    if lo.vpp > 1 and lo.schedule != "interleaved":
        return f"vpp={lo.vpp} needs schedule=interleaved"
    if model.layers % (lo.pp * lo.vpp):
        return f"pp x vpp = {lo.pp * lo.vpp} must divide the {model.layers} layers"
    if shape.global_batch % (lo.dp * lo.mbs):
        return f"dp x mbs = {lo.dp * lo.mbs} must divide the global batch of {shape.global_batch}"
    if lo.schedule == "interleaved" and lo.micro_batches(shape) % lo.pp:
        return (f"the interleaved schedule needs the {lo.micro_batches(shape)} micro-batches "
                f"to be a multiple of pp={lo.pp}")
    return None


def require(layout: Layout, model, n_gpus: int, shape: TrainShape) -> None:
    reason = check(layout, model, n_gpus, shape)
    if reason:
        raise ConfigError(f"layout {layout.text()} cannot run: {reason}.")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ember_refuses(layout: Layout) -> str | None:
    """Why ember's trainer would not run a layout that the planner can still predict (other
    frameworks run it, and published runs use it): plain DDP beside tensor or pipeline
    parallelism, which ember runs with ZeRO >= 1 (FSDP2) instead."""
    if layout.zero == 0 and layout.dp > 1 and (layout.tp > 1 or layout.pp > 1):
        return "ember's trainer runs data parallelism beside tensor or pipeline parallelism with zero >= 1"
    return None


def candidates(model, n_gpus: int, gpus_per_node: int, shape: TrainShape,
               max_mbs: int = 256, max_vpp: int = 8, fixed: dict | None = None,
               ember_only: bool = True) -> list[Layout]:
    """Every legal layout the search considers: tp within a node, every pp, ZeRO 0-3 sharded
    over all data-parallel ranks or within a node (hybrid), micro-batches in powers of two up to `max_mbs`,
    and all schedules and checkpointing policies. `fixed` pins fields (e.g. tp, pp, dp);
    `ember_only` keeps the layouts ember's trainer runs (see `ember_refuses`)."""
    fixed = fixed or {}
    out = []
    for tp in divisors(n_gpus):
        if tp > gpus_per_node or model.heads % tp or model.kv_heads % tp:
            continue
        for pp in divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if model.layers % pp or shape.global_batch % dp:
                continue
            if any(fixed.get(key, value) != value for key, value in (("tp", tp), ("pp", pp), ("dp", dp))):
                continue
            shards = sorted(({dp} | {d for d in divisors(dp) if d * tp <= gpus_per_node}) - {1})
            data = [(0, 1, dp)] + [(zero, s, dp // s) for zero in (1, 2, 3) for s in shards]
            schedules = [("1f1b", 1)] + ([("gpipe", 1)] + [
                ("interleaved", v) for v in divisors(model.layers // pp) if 2 <= v <= max_vpp] if pp > 1 else [])
            micro = [2**i for i in range(10) if 2**i <= max_mbs and (shape.global_batch // dp) % 2**i == 0]
            seq_parallel = (False, True) if tp > 1 else (False,)
            for (zero, shard, rep), mbs, (schedule, vpp), sp, recompute in itertools.product(
                    data, micro, schedules, seq_parallel, RECOMPUTE):
                layout = Layout(tp, pp, shard, rep, zero, sp, vpp, schedule, mbs, recompute)
                pinned = all(getattr(layout, k) == v for k, v in fixed.items() if k not in ("tp", "pp", "dp"))
                if pinned and check(layout, model, n_gpus, shape) is None and not (
                        ember_only and ember_refuses(layout)):
                    out.append(layout)
    return out
