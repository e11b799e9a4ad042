"""The planner's description of a model: the shape fields of `ModelConfig` plus what the
planner needs besides (the share of tokens predicted, ALiBi positions of a preset). Built
from a recipe TOML or from a preset of a published architecture.

Presets follow the papers and released configs: GPT-3 175B (Brown et al. 2020, Table 2.1),
BLOOM 176B (BigScience 2022), Llama 2 (Touvron et al. 2023) and Llama 3 (Meta 2024, grouped
query attention with 8 key/value heads in all but Llama 2 7B/13B), BERT-base (Devlin et
al. 2019) and GPT-2 small (Radford et al. 2019).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ember.config import ConfigError, ModelConfig, check_choice, check_model_shape, coerce, load_config


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    mlp_hidden: int
    vocab_size: int
    kv_heads: int = 0  # 0 = heads (multi-head attention)
    activation: str = "gelu"  # gelu, geglu, swiglu
    objective: str = "causal"  # causal or mlm
    predicted_fraction: float = 1.0  # share of tokens the output layer sees (sparse MLM)
    tie_embeddings: bool = True
    positions: str = "learned"  # learned, sinusoidal, rotary, alibi
    norm: str = "layernorm"
    bias: bool = False
    dropout: bool = False  # dropout layers store a 1-byte mask per element
    vocab_multiple: int = 128
    max_seq_len: int = 2048

    def __post_init__(self):
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def causal(self) -> bool:
        return self.objective == "causal"

    def with_shape(self, **fields) -> "ModelSpec":
        return replace(self, **fields)

    def to_dict(self) -> dict:
        return asdict(self)


def _gpt(name, layers, hidden, heads, vocab=50257, seq=2048, dropout=True, **kw) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, 4 * hidden, vocab, bias=True, dropout=dropout,
                     max_seq_len=seq, **kw)


def _llama(name, layers, hidden, heads, kv_heads, mlp, vocab, seq) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, mlp, vocab, kv_heads=kv_heads, activation="swiglu",
                     tie_embeddings=False, positions="rotary", norm="rmsnorm", max_seq_len=seq)


PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _gpt("gpt3-175b", 96, 12288, 96),
    _gpt("bloom-176b", 70, 14336, 112, vocab=250880, dropout=False, positions="alibi"),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # BERT predicts only the 15% masked positions (the released code gathers them first).
    ModelSpec("bert-base", 12, 768, 12, 3072, 30522, objective="mlm", predicted_fraction=0.15, bias=True,
              dropout=True, max_seq_len=512),
    _gpt("gpt2-small", 12, 768, 12, seq=1024),
)}


def from_config(cfg: ModelConfig, name: str, mlm_rate: float = 0.15) -> ModelSpec:
    """The planner's view of a recipe's model; a sparse-prediction MLM predicts `mlm_rate`."""
    if cfg.vocab_size <= 0:
        raise ConfigError(f"{name} leaves model.vocab_size to the data; give it with --set model.vocab_size=N "
                          "(the prepared data's manifest.json says it) so the planner can size the embedding "
                          "and output layers.")
    sparse = cfg.objective == "mlm" and cfg.sparse_prediction
    return ModelSpec(name, cfg.layers, cfg.hidden, cfg.heads, cfg.mlp_hidden, cfg.vocab_size,
                     kv_heads=cfg.kv_heads, activation=cfg.activation, objective=cfg.objective,
                     predicted_fraction=mlm_rate if sparse else 1.0, tie_embeddings=cfg.tie_embeddings,
                     positions=cfg.positions, norm=cfg.norm, bias=cfg.bias, dropout=cfg.dropout > 0,
                     vocab_multiple=cfg.vocab_multiple, max_seq_len=cfg.max_seq_len)


# The ModelConfig fields a preset has, as `ember train --set model.KEY=...` names them: what
# `ember plan --set` may change in a preset, and what a preset's train command spells out.
MODEL_KEYS = ("objective", "hidden", "layers", "heads", "kv_heads", "mlp_hidden", "activation", "norm", "bias",
              "positions", "tie_embeddings", "vocab_size", "max_seq_len")


def resolve_model(text: str, overrides: list[str] = ()) -> tuple[ModelSpec, str | None]:
    """A preset name or a recipe TOML path, with `section.key=value` overrides (a recipe's
    any, a preset's model.* shape) -> (spec, the recipe path or None for presets)."""
    key = text.strip().lower()
    if key in PRESETS:
        return with_overrides(PRESETS[key], overrides), None
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        config = load_config(path, list(overrides))
        return from_config(config.model, path.stem, config.data.mlm_rate), str(path)
    raise ConfigError(f"unknown model {text!r}; give a recipe .toml or one of {', '.join(PRESETS)}.")


def with_overrides(spec: ModelSpec, overrides: list[str]) -> ModelSpec:
    """A preset with some of its shape changed (`model.layers=48`, ...), named for the
    change. What is not given keeps its proportion: the MLP width its ratio to the hidden
    width, and a multi-head preset one key/value head per head."""
    changes: dict[str, object] = {}
    for item in overrides:
        dotted, eq, value = item.partition("=")
        section, _, name = dotted.strip().partition(".")
        value = value.strip()
        if not eq or section != "model" or name not in MODEL_KEYS or not value:
            raise ConfigError(f"--set {item!r}: a preset takes model.KEY=VALUE with KEY one of "
                              f"{', '.join(MODEL_KEYS)}.")
        changes[name] = coerce(dotted.strip(), value, getattr(spec, name))  # as a recipe's --set reads it
        check_choice(f"model.{name}", changes[name])
    if changes.get("vocab_size") == 0:  # a recipe's 0 means "from the data"; a preset has none
        raise ConfigError("a preset's model.vocab_size must be at least 1.")
    if not changes:
        return spec
    named = ", ".join(f"{k}={str(v).lower()}" for k, v in changes.items())
    if "heads" in changes and "kv_heads" not in changes and spec.kv_heads == spec.heads:
        changes["kv_heads"] = changes["heads"]
    if "hidden" in changes and "mlp_hidden" not in changes:
        changes["mlp_hidden"] = spec.mlp_hidden * changes["hidden"] // spec.hidden
    out = replace(spec, name=f"{spec.name} with {named}", **changes)
    check_model_shape(out)  # the rules a recipe's [model] obeys
    return out
