"""Typed configuration: TOML recipes, dotted `--set` overrides, validation.

A run is described by one `Config` with six sections (model, data, optim, schedule,
train, parallel). Recipes in `configs/` set what differs from the defaults below; `--set
section.key=value` overrides one field from the command line. Every mistake a user can
make here raises `ConfigError` with one sentence that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.budget import parse_budget, parse_interval
from ember.errors import ConfigError

__all__ = ["ConfigError"]  # raised by everything below; callers import it from here


@dataclass
class ModelConfig:
    objective: str = "causal"  # "mlm" (masked LM) or "causal"
    vocab_size: int = 0  # 0 = the prepared data's vocabulary; the embedding is padded up from it
    vocab_multiple: int = 128  # pad the embedding to a multiple of this for fast matmuls
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 0  # key/value heads, each shared by heads / kv_heads query heads (GQA); 0 = heads
    mlp_hidden: int = 3072
    activation: str = "gelu"  # gelu, geglu, swiglu
    norm: str = "layernorm"  # layernorm, rmsnorm
    norm_eps: float = 1e-5
    bias: bool = False
    positions: str = "learned"  # learned, sinusoidal, rotary
    rope_theta: float = 10000.0
    max_seq_len: int = 1024
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    scaled_residual_init: bool = True  # GPT-2: output projections std / sqrt(2 * layers)
    sparse_prediction: bool = True  # MLM only: the output layer sees masked positions only
    # The kernel of data.document_mask: auto (flex_attention on CUDA, SDPA with a dense mask elsewhere), flex, sdpa.
    document_kernel: str = "auto"

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple


@dataclass
class DataConfig:
    mlm_rate: float = 0.15
    mask_token_frac: float = 0.8  # of the chosen positions: replaced by [MASK]
    random_token_frac: float = 0.1  # replaced by a random token; the rest stay unchanged
    seed: int = 0  # shuffling and masking
    # Attend only within the token's own document (needs data prepared with --doc-boundaries);
    # off by default because an arbitrary mask costs SDPA its fastest kernels.
    document_mask: bool = False
    order: str = "shuffle"  # or "curriculum": first epoch in ascending key order (prepare --curriculum)
    verify: bool = True  # hash every shard (and its companions) against the manifest before training
    prefetch: bool = True  # make the next step's batch on a background thread while this one runs


@dataclass
class OptimConfig:
    lr: float = 6e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0  # gradient-norm clipping; 0 turns it off


@dataclass
class ScheduleConfig:
    lr: str = "cosine"  # triangle, cosine, wsd, constant
    warmup: float = 0.02  # fraction of the budget
    decay: float = 0.2  # wsd: fraction of the budget spent decaying at the end
    min_lr_ratio: float = 0.1  # cosine and wsd end at lr * min_lr_ratio
    triangle_start: float = 0.25  # triangle starts at this fraction of the peak lr
    triangle_peak: float = 0.75  # triangle peaks at this fraction of the budget
    batch_start: int = 0  # sequences per step at the start of the ramp; 0 = no ramp
    batch_ramp: float = 0.0  # fraction of the budget by which the full batch is reached


@dataclass
class TrainConfig:
    budget: str = "200steps"  # 10m, 2h, 1e8tok, 500steps; --budget overrides
    micro_batch: int = 16  # sequences per forward pass
    global_batch: int = 64  # sequences per optimizer step
    log_every: int = 10  # steps
    eval_every: str = "100steps"  # steps or a time such as 5m
    eval_batches: int = 8
    checkpoint_every: str = "30m"  # steps or a time; a final checkpoint is always written
    keep_checkpoints: int = 2
    # Write checkpoints on a background thread (state copied to host memory first), so
    # training goes on while they are written; still published only once complete. "auto"
    # = on CUDA, where the writer does not compete with the step for the CPU.
    checkpoint_async: str = "auto"  # auto, true, false
    # auto: bf16 on CUDA GPUs that have it, fp16 with loss scaling on older ones, fp32 elsewhere
    precision: str = "auto"  # auto, bf16, fp16, fp32
    # torch.compile each block: "auto" = on CUDA (where fused kernels pay for the compile
    # time), except for the zero-bubble pipeline schedules that cannot run compiled stages.
    compile: str = "auto"  # auto, true, false
    device: str = "auto"  # auto, cpu, cuda, cuda:1, mps
    seed: int = 0  # model initialisation and dropout
    # Seconds a collective waits for the other ranks before the job ends with an error: a
    # rank that died or hangs stops the run instead of holding every GPU until the scheduler does.
    timeout_s: float = 600.0
    # A non-finite loss or a loss spike (above the mean of the last spike_window steps by
    # spike_sigma standard deviations): "rollback" to the newest checkpoint before it and
    # skip the data up to it, "stop" without saving, or "off". Checked on logged steps.
    on_spike: str = "rollback"
    trackers: list[str] = field(default_factory=list)  # beside metrics.jsonl: "tensorboard", "wandb", "trackio"
    spike_sigma: float = 6.0
    spike_window: int = 100
    # Profile logged steps for where the time goes (compute, exposed communication,
    # pipeline bubble): on = every logged step; auto = one logged step in 10, under
    # torchrun only, where there is communication to see.
    breakdown: str = "auto"  # auto, on, off


@dataclass
class ParallelConfig:
    """The layout of a run over `torchrun` processes (docs/parallel.md); the defaults are
    one process, and data parallel over whatever world size torchrun starts."""

    dp_replicate: int = 1  # data-parallel replicas (hybrid sharding when dp_shard > 1 too)
    dp_shard: int = -1  # ranks that shard model states inside a replica; -1 = the rest of the world
    zero: int = 0  # 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters (sharded over dp_shard)
    tp: int = 1  # tensor parallel
    sp: bool = False  # sequence parallel (needs tp > 1)
    pp: int = 1  # pipeline stages
    vpp: int = 1  # virtual stages per pipeline rank (interleaved, zero_bubble; zbv: 2)
    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved; zero_bubble, zbv where PyTorch has them
    recompute: str = "none"  # activation checkpointing: none, selective, full
    recompute_every: int = 1  # the policy covers blocks 0, k, 2k, ... (k = this; 1 = every block)
    grad_dtype: str = "fp32"  # data-parallel gradient reduction: fp32, or bf16 (half the bytes; bf16 compute only)
    # Layers of each of the pp x vpp stages in model order, e.g. [5, 6, 6, 5]; empty: equal
    # when pp x vpp divides model.layers, else balanced by cost (the last stage holds the output layer).
    stage_layers: list[int] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


_CHOICES = {
    "model.objective": ("mlm", "causal"),
    "data.order": ("shuffle", "curriculum"),
    "model.activation": ("gelu", "geglu", "swiglu"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.positions": ("learned", "sinusoidal", "rotary"),
    "model.document_kernel": ("auto", "flex", "sdpa"),
    "parallel.grad_dtype": ("fp32", "bf16"),
    "schedule.lr": ("triangle", "cosine", "wsd", "constant"),
    "train.precision": ("auto", "bf16", "fp16", "fp32"),
    "train.breakdown": ("auto", "on", "off"),
    "train.compile": ("auto", "true", "false"),
    "train.checkpoint_async": ("auto", "true", "false"),
    "train.on_spike": ("rollback", "stop", "off"),
}


# The valid range of every numeric key that has one: (low, high, low allowed, high allowed).
# Floats must also be finite. `validate` checks them before anything is built.
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "model.norm_eps": (0.0, 1.0, False, False),
    "model.init_std": (0.0, 1.0, False, True),
    "model.rope_theta": (0.0, math.inf, False, False),
    "optim.lr": (0.0, 1.0, False, True),
    "optim.eps": (0.0, 1.0, False, False),
    "optim.weight_decay": (0.0, 10.0, True, True),
    "optim.clip": (0.0, math.inf, True, False),
    "train.log_every": (1, math.inf, True, False),
    "train.eval_batches": (1, math.inf, True, False),
    "train.keep_checkpoints": (1, math.inf, True, False),
    "train.seed": (0, 2**63 - 1, True, True),  # torch.manual_seed's range
    "train.timeout_s": (0.0, math.inf, False, False),
    "train.spike_sigma": (0.0, math.inf, False, False),
    "train.spike_window": (4, math.inf, True, False),
    "data.seed": (0, 2**63 - 1, True, True),
    "schedule.batch_start": (0, math.inf, True, False),
}


def _check_ranges(config: "Config") -> None:
    for dotted, (low, high, low_ok, high_ok) in _RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        inside = (low < value or (low_ok and value == low)) and (value < high or (high_ok and value == high))
        if not math.isfinite(value) or not inside:
            top = "inf" if high == math.inf else (str(high) if isinstance(high, int) else f"{high:g}")
            span = ("[" if low_ok else "(") + f"{low:g}, " + top + \
                   ("]" if high_ok else ")")
            raise ConfigError(f"{dotted} must be a finite number in {span}, not {value!r}.")
    if not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in config.optim.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.95], not {config.optim.betas}.")


def coerce(name: str, value: Any, current: Any) -> Any:
    """Convert `value` to the type of the field's default, or explain why it cannot."""
    kind = type(current)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, bool):
            return value
    elif kind is int and not isinstance(value, bool):
        try:
            number = float(value)
            if number == int(number):
                return int(number)
        except (TypeError, ValueError, OverflowError):  # OverflowError: inf, 1e400
            pass
    elif kind is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif kind is str:
        return str(value).lower() if isinstance(value, bool) else str(value)  # compile = true
    elif kind is list:
        if isinstance(value, str):  # --set a=[x, "y"]: a TOML array, or bare words between commas
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
            value = [value] if isinstance(value, str) else value
        if isinstance(value, list):
            try:
                return [type(current[0])(v) for v in value] if current else list(value)
            except (TypeError, ValueError):
                pass
    what = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    raise ConfigError(f"{name} must be {what.get(kind, kind.__name__)}, not {value!r}.")


def _set(config: Config, dotted: str, value: Any) -> None:
    section_name, _, key = dotted.partition(".")
    section = getattr(config, section_name, None)
    if not dataclasses.is_dataclass(section) or not key:
        sections = ", ".join(f.name for f in dataclasses.fields(Config))
        raise ConfigError(f"unknown config section in {dotted!r}; sections are {sections}.")
    names = [f.name for f in dataclasses.fields(section)]
    if key not in names:
        raise ConfigError(f"unknown config key {dotted!r}; {section_name} has {', '.join(names)}.")
    setattr(section, key, coerce(dotted, value, getattr(section, key)))


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML recipe at `path`, then `section.key=value` overrides."""
    config = Config()
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; give a recipe .toml file.")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist.")
        try:
            data = tomllib.loads(path.read_text())
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not a text (TOML) file.") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {path} is not valid TOML ({err}).") from None
        for section_name, section in data.items():
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: top-level key {section_name!r} must be a [section].")
            for key, value in section.items():
                _set(config, f"{section_name}.{key}", value)
    for item in overrides:
        dotted, eq, value = item.partition("=")
        if not eq or not dotted.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value.")
        _set(config, dotted.strip(), value.strip())
    validate(config)
    return config


def check_choice(dotted: str, value: Any) -> None:
    """Refuse a value outside the key's choices (keys without a fixed set take any)."""
    choices = _CHOICES.get(dotted)
    if choices is not None and value not in choices:
        raise ConfigError(f"{dotted} must be one of {', '.join(choices)}, not {value!r}.")


def check_model_shape(m) -> None:
    """The rules a model's shape obeys, for a [model] section or a planner preset alike."""
    for name in ("vocab_multiple", "hidden", "layers", "heads", "mlp_hidden", "max_seq_len"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be at least 1.")
    if m.hidden % m.heads:
        raise ConfigError(f"model.hidden ({m.hidden}) must be divisible by model.heads ({m.heads}).")
    if m.kv_heads < 0 or (m.kv_heads and m.heads % m.kv_heads):
        raise ConfigError(f"model.kv_heads must be 0 (one per query head) or a divisor of model.heads "
                          f"({m.heads}), not {m.kv_heads}.")
    if m.positions == "rotary" and (m.hidden // m.heads) % 2:
        raise ConfigError("rotary positions need an even head size (model.hidden / model.heads).")
    if m.vocab_size < 0:
        raise ConfigError("model.vocab_size must be 0 (take it from the data) or positive.")


def validate(config: Config) -> None:
    for dotted in _CHOICES:
        section, key = dotted.split(".")
        check_choice(dotted, getattr(getattr(config, section), key))
    m, t = config.model, config.train
    check_model_shape(m)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout must be in [0, 1).")
    if m.document_kernel == "flex" and m.dropout:
        raise ConfigError("model.document_kernel=flex has no attention dropout; set model.dropout=0 or "
                          "model.document_kernel=sdpa.")
    d = config.data
    if not 0.0 < d.mlm_rate < 1.0:
        raise ConfigError("data.mlm_rate must be between 0 and 1.")
    if not (0.0 <= d.mask_token_frac <= 1.0 and 0.0 <= d.random_token_frac <= 1.0
            and d.mask_token_frac + d.random_token_frac <= 1.0):  # written so that NaN fails too
        raise ConfigError("data.mask_token_frac + data.random_token_frac must lie in [0, 1].")
    if t.micro_batch < 1 or t.global_batch < t.micro_batch or t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch ({t.global_batch}) must be a positive multiple of "
                          f"train.micro_batch ({t.micro_batch}).")
    s = config.schedule
    if s.batch_start and (s.batch_start < t.micro_batch or s.batch_start > t.global_batch):
        raise ConfigError(f"schedule.batch_start ({s.batch_start}) must lie between train.micro_batch "
                          f"({t.micro_batch}) and train.global_batch ({t.global_batch}); set it in that range, "
                          "or 0 for no batch-size ramp.")
    for name in ("warmup", "decay", "batch_ramp", "triangle_peak", "triangle_start", "min_lr_ratio"):
        if not 0.0 <= getattr(s, name) <= 1.0:
            raise ConfigError(f"schedule.{name} must be a fraction in [0, 1].")
    if s.lr == "wsd" and s.warmup + s.decay > 1.0:
        raise ConfigError(f"schedule.warmup ({s.warmup:g}) + schedule.decay ({s.decay:g}) must be at most 1 for "
                          "schedule.lr = \"wsd\": its decay would start inside the warm-up.")
    if s.lr == "triangle" and s.triangle_peak >= 1.0:
        raise ConfigError("schedule.triangle_peak must be below 1, or the triangle ends at its peak learning rate.")
    if len(config.optim.betas) != 2:
        raise ConfigError("optim.betas must hold two numbers, e.g. [0.9, 0.98].")
    _check_ranges(config)
    unknown = [name for name in t.trackers if name not in ("tensorboard", "wandb", "trackio")]
    if unknown:
        raise ConfigError(f"train.trackers takes \"tensorboard\", \"wandb\" and \"trackio\", "
                          f"not {', '.join(map(repr, unknown))}.")
    validate_parallel(config.parallel)
    parse_budget(t.budget, "train.budget")
    parse_interval(t.eval_every, "train.eval_every")
    parse_interval(t.checkpoint_every, "train.checkpoint_every")


def validate_parallel(p: ParallelConfig) -> None:
    """The range of each [parallel] value on its own; how they fit each other, the model,
    the batch and the world size is `ember.layout.problems`, asked once the world size is
    known."""
    for name in ("dp_replicate", "tp", "pp", "vpp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be at least 1.")
    if p.recompute_every < 1:
        raise ConfigError(f"parallel.recompute_every must be at least 1 (1 recomputes every block, k every k-th), "
                          f"not {p.recompute_every}.")
    if p.dp_shard != -1 and p.dp_shard < 1:
        raise ConfigError("parallel.dp_shard must be at least 1, or -1 for the rest of the world size.")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero must be 0, 1, 2 or 3, not {p.zero}.")
    try:
        p.stage_layers = [int(n) for n in p.stage_layers]
    except (TypeError, ValueError):
        raise ConfigError(f"parallel.stage_layers must be a list of whole numbers of layers per pipeline stage, "
                          f"e.g. [5, 6, 6, 5], not {p.stage_layers!r}.") from None


def to_toml(config: Config) -> str:
    """The resolved configuration as TOML; every value is a scalar or a flat list."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = []
    for section, fields in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {value(v)}" for key, v in fields.items()]
        lines.append("")
    return "\n".join(lines)
