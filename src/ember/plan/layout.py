"""The planner's side of a layout: the training shape it runs, how to read one from
`--layout`, and the space the search walks. The layout type and its rules are
`ember.layout`'s, shared with the trainer.

`--layout` keys (those of the trainer's [parallel] section, and `mbs` for train.micro_batch):
  tp, sp            tensor parallelism and sequence parallelism (norms/dropout split by tp)
  pp, vpp, schedule pipeline stages, virtual stages per GPU, 1f1b / gpipe / interleaved /
                    zero_bubble / zbv (zbv: vpp defaults to its 2)
  stage_layers      layers of each of the pp x vpp stages, e.g. 6/6/.../4 (default: equal when
                    they divide, else balanced by cost)
  dp                data-parallel size = dp_replicate x dp_shard
  zero              0 = replicate everything; 1 shards optimizer states, 2 also gradients,
                    3 also weights, each over dp_shard ranks (dp_shard defaults to dp)
  mbs               micro-batch size (sequences); gradient accumulation = global / (dp·mbs)
  recompute         activation checkpointing: none, selective (attention core) or full
  recompute_every   the policy covers every k-th layer only (1: all); the search also tries
                    full recomputation of every second layer, half the cost for about half
                    the activations (Megatron-LM's --recompute-num-layers does the same)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ember.config import ConfigError
from ember.layout import RECOMPUTE, SCHEDULES, ZERO_BUBBLE, Layout, available_schedules, problems

# (recompute, recompute_every) pairs the search tries.
POLICIES = tuple((policy, 1) for policy in RECOMPUTE) + (("full", 2),)
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")  # fp32: no autocast, as ember trains on a CPU by default
LONG_SEQUENCE = 16384  # from here the search also tries context parallelism (other stacks)
MAX_CP = 32


@dataclass(frozen=True)
class TrainShape:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    # bf16 or fp16: 2-byte activations and weights, the same peak; fp8: also, with the weight
    # matmuls in FP8 (plan/timing.py); fp32: a CPU run, 4-byte
    precision: str = "bf16"

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


_INT_KEYS = ("tp", "cp", "pp", "dp", "dp_shard", "dp_replicate", "zero", "vpp", "mbs", "recompute_every")
_KEYS = _INT_KEYS + ("sp", "schedule", "recompute", "stage_layers")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def parse_layout(text: str, n_gpus: int) -> Layout:
    """'tp=8,pp=12,dp=4,zero=1,mbs=1,recompute=full' -> Layout; dp defaults to what is left."""
    values: dict[str, str] = {}
    if not text.strip():
        raise ConfigError("--layout is empty; give key=value items such as tp=2,pp=2,zero=1,mbs=1.")
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ConfigError(f"--layout {text!r} has an empty item between commas.")
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in _KEYS or not value.strip():
            raise ConfigError(f"--layout item {item!r} is not key=value with a key among {', '.join(_KEYS)}.")
        if key in values:
            raise ConfigError(f"--layout gives {key} twice ({text!r}); give each key once.")
        values[key] = value.strip().lower()
    ints = {}
    for key in _INT_KEYS:
        if key in values:
            if key == "zero" and not values[key].isdigit():
                raise ConfigError(f"--layout zero must be 0, 1, 2 or 3, not {values[key]!r}.")
            if not values[key].isdigit() or (int(values[key]) < 1 and key != "zero"):
                raise ConfigError(f"--layout {key} must be a positive whole number, not {values[key]!r}.")
            ints[key] = int(values[key])
    if values.get("sp", "0") not in _TRUE + _FALSE:
        raise ConfigError(f"--layout sp must be 0 or 1 (or false or true), not {values['sp']!r}.")
    for key, choices in (("schedule", tuple(SCHEDULES)), ("recompute", RECOMPUTE)):
        if values.get(key, choices[0]) not in choices:
            raise ConfigError(f"--layout {key} must be one of {', '.join(choices)}, not {values[key]!r}.")
    if "recompute_every" in ints and values.get("recompute", "none") == "none":
        raise ConfigError("--layout recompute_every says which blocks recompute; give it with recompute=full or "
                          "selective, or leave it out.")
    tp, pp, cp = (ints.get(k, 1) for k in ("tp", "pp", "cp"))
    vpp = ints.get("vpp", 2 if values.get("schedule") == "zbv" else 1)
    zero = ints.get("zero", 0)
    if zero > 3:
        raise ConfigError(f"--layout zero must be 0, 1, 2 or 3, not {zero}.")
    if "dp" in ints:
        dp = ints["dp"]
    elif "dp_shard" in ints and "dp_replicate" in ints:
        dp = ints["dp_shard"] * ints["dp_replicate"]
    else:
        if n_gpus % (tp * cp * pp):
            raise ConfigError(f"--layout tp x cp x pp = {tp} x {cp} x {pp} = {tp * cp * pp} does not divide the "
                              f"{n_gpus} GPUs; the data-parallel ranks are what is left.")
        dp = max(1, n_gpus // (tp * cp * pp))
    if zero:  # shard over every data-parallel rank unless told otherwise
        shard = ints.get("dp_shard", dp // ints.get("dp_replicate", 1))
    else:
        shard = ints.get("dp_shard", 1)
    replicate = ints.get("dp_replicate", dp // shard)
    if shard * replicate != dp:
        raise ConfigError(f"--layout dp ({dp}) must equal dp_shard x dp_replicate ({shard} x {replicate}).")
    if shard > 1 and not zero:
        raise ConfigError("--layout dp_shard > 1 shards state, which needs zero=1, 2 or 3.")
    split = values.get("stage_layers", "")
    if split and not all(n.isdigit() for n in split.split("/")):
        raise ConfigError(f"--layout stage_layers must be layer counts joined by '/', e.g. 6/6/6/4, not {split!r}.")
    schedule = values.get("schedule", "interleaved" if vpp > 1 else "1f1b")
    return Layout(tp=tp, pp=pp, dp_shard=shard, dp_replicate=replicate, zero=zero,
                  sp=values.get("sp", "0") in _TRUE, vpp=vpp, schedule=schedule,
                  micro_batch=ints.get("mbs", 1), recompute=values.get("recompute", "none"),
                  recompute_every=ints.get("recompute_every", 1),
                  stage_layers=tuple(int(n) for n in split.split("/")) if split else (), cp=cp)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidates(model, n_gpus: int, gpus_per_node: int, shape: TrainShape,
               max_mbs: int = 256, max_vpp: int = 8, fixed: dict | None = None,
               ember_only: bool = True) -> list[Layout]:
    """Every legal layout the search considers: tp within a node, every pp, ZeRO 0-3 sharded
    over all data-parallel ranks or within a node (hybrid), micro-batches in powers of two up to `max_mbs`,
    and all schedules (interleaved in equal chunks where the stages divide the layers, else in
    balanced unequal ones) and checkpointing policies. `fixed` pins fields (e.g. tp, pp, dp);
    `ember_only` keeps the layouts ember's trainer runs (`ember.layout.problems(ember=True)`)."""
    fixed = fixed or {}
    max_vpp = max(max_vpp, fixed.get("vpp", 0))  # a run's stated interleaving, however deep
    out = []
    for cp in context_splits(n_gpus, shape, fixed, ember_only):
        out += _for_cp(model, n_gpus, gpus_per_node, shape, max_mbs, max_vpp, fixed, ember_only, cp)
    return out


def context_splits(n_gpus: int, shape: TrainShape, fixed: dict, ember_only: bool) -> list[int]:
    """The cp sizes the search tries: a stated one; else 1, and for other software's long
    sequences (at least LONG_SEQUENCE tokens, where context parallelism is what keeps their
    activations in memory) powers of two up to MAX_CP that cut the sequence evenly."""
    if "cp" in fixed:
        return [fixed["cp"]]
    if ember_only or shape.seq_len < LONG_SEQUENCE:
        return [1]
    return [c for c in (1, 2, 4, 8, 16, 32) if c <= min(MAX_CP, n_gpus) and shape.seq_len % (2 * c) == 0
            and n_gpus % c == 0]


def _for_cp(model, n_gpus: int, gpus_per_node: int, shape: TrainShape, max_mbs: int, max_vpp: int,
            fixed: dict, ember_only: bool, cp: int) -> list[Layout]:
    out = []
    for tp in divisors(n_gpus // cp):
        if tp > gpus_per_node or model.heads % tp or model.kv_heads % tp:
            continue
        for pp in divisors(n_gpus // (tp * cp)):
            dp = n_gpus // (tp * cp * pp)
            if model.layers < pp or shape.global_batch % dp:
                continue
            if any(fixed.get(key, value) != value for key, value in (("tp", tp), ("pp", pp), ("dp", dp))):
                continue
            # A shard group of one rank saves nothing, unless cp ranks share it.
            shards = sorted(({dp} | {d for d in divisors(dp) if d * tp <= gpus_per_node}) - ({1} if cp == 1 else set()))
            data = [(0, 1, dp)] + [(zero, s, dp // s) for zero in (1, 2, 3) for s in shards]
            # Interleaving cuts each rank's layers into vpp chunks. When pp divides the layers,
            # equal chunks exist and are the ones offered: unequal chunks on one rank stall the
            # schedule in a way the pipeline formula (per-rank totals) does not see. When it
            # does not (Llama 3 405B: 126 layers on 16 stages), any vpp is offered, balanced.
            even = model.layers % pp == 0
            vpps = [v for v in range(2, max_vpp + 1)
                    if pp * v <= model.layers and (not even or (model.layers // pp) % v == 0)]
            schedules = [("1f1b", 1)] + ([("gpipe", 1)] + [("interleaved", v) for v in vpps] if pp > 1 else [])
            if pp > 1 and ember_only:  # PyTorch's zero-bubble schedules, which ember's trainer runs
                schedules += [(name, v) for name in ZERO_BUBBLE if name in available_schedules()
                              for v in vpps if name == "zero_bubble" or v == 2]
            micro = [2**i for i in range(10) if 2**i <= max_mbs and (shape.global_batch // dp) % 2**i == 0]
            seq_parallel = (False, True) if tp > 1 else (False,)
            for (zero, shard, rep), mbs, (schedule, vpp), sp, (recompute, every) in itertools.product(
                    data, micro, schedules, seq_parallel, POLICIES):
                layout = Layout(tp, pp, shard, rep, zero, sp, vpp, schedule, mbs, recompute, every, cp=cp)
                pinned = all(getattr(layout, k) == v for k, v in fixed.items() if k not in ("tp", "pp", "dp"))
                if pinned and not problems(layout, model, shape.global_batch, n_gpus, seq_len=shape.seq_len,
                                           ember=ember_only):
                    out.append(layout)
    return out
