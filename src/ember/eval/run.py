"""Open a run directory for evaluation or export: its config, its weights, its tokenizer.

The trainer leaves `config.toml`, `tokenizer.json` and `data.json` in the run directory,
so a run is self-contained. Weights come from `model.safetensors` (a finished run) or
else the newest complete checkpoint (an interrupted one). A checkpoint folder
`RUN_DIR/checkpoints/step_N` may be named directly to evaluate an earlier point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ember.config import Config, ConfigError, load_config
from ember.data import load_tokenizer, special_token_ids
from ember.data.manifest import tokenizer_sha256
from ember.model import Transformer
from ember.train.checkpoint import is_checkpoint, latest, step_of
from ember.train.model_file import load_model, model_step


@dataclass
class Run:
    run_dir: Path
    config: Config
    weights: Path  # model.safetensors to load
    tokenizer_path: Path
    tokenizer: Tokenizer
    special_tokens: dict  # role -> id: sep, pad, mask, cls, unk (as found in the tokenizer)
    data: dict  # data.json, or {} for runs that predate it

    @property
    def objective(self) -> str:
        return self.config.model.objective

    def result_path(self, folder: str, stem: str) -> Path:
        return result_path(self.run_dir, self.weights, folder, stem)

    def build_model(self, dropout: float | None = None, device: str | torch.device = "cpu") -> Transformer:
        """The trained Transformer; `dropout` overrides the recipe's (fine-tuning uses 0.1)."""
        cfg = self.config.model if dropout is None else replace(self.config.model, dropout=dropout)
        model = Transformer(cfg)
        load_model(model, self.weights)
        return model.to(device)


def _locate(path: Path) -> tuple[Path, Path]:
    """(run directory, weights file) for a run directory or one of its checkpoint folders."""
    if (path / "config.toml").is_file():
        newest = latest(path)
        if (path / "model.safetensors").is_file() and not _overtaken(path / "model.safetensors", newest):
            return path, path / "model.safetensors"
        if newest is None:
            raise ConfigError(f"{path} holds no model.safetensors and no complete checkpoint yet; "
                              "let the run save a checkpoint first.")
        return path, _weights_in(newest)
    run_dir = path.parent.parent  # RUN_DIR/checkpoints/step_N
    if (run_dir / "config.toml").is_file() and ((path / "model.safetensors").is_file() or is_checkpoint(path)):
        return run_dir, _weights_in(path)
    raise ConfigError(f"{path} is not an ember run directory (no config.toml); "
                      "pass the --out folder of `ember train` or one of its checkpoints/step_* folders.")


def _overtaken(model_file: Path, newest: Path | None) -> bool:
    """Whether a checkpoint is further on than the run's model file: a run resumed after it
    finished, to train on, and stopped before it finished again. The file's recorded step
    says; one written before ember recorded it is compared by modification time."""
    if newest is None:
        return False
    step = model_step(model_file)
    if step is not None:
        return step_of(newest) > step
    return (newest / "state.json").stat().st_mtime > model_file.stat().st_mtime


def result_path(run_dir: Path, weights: Path, folder: str, stem: str) -> Path:
    """Where an evaluation of `weights` is written by default: `RUN_DIR/folder/stem.json` for
    the final model, `stem_step_N.json` for a checkpoint's, so that scoring an earlier
    checkpoint never replaces the final model's numbers."""
    run_dir, weights = Path(run_dir), Path(weights)
    if weights == run_dir / "model.safetensors":
        return run_dir / folder / f"{stem}.json"
    checkpoint = weights if weights.suffix != ".safetensors" else weights.parent
    return run_dir / folder / f"{stem}_{checkpoint.name}.json"


def _weights_in(folder: Path) -> Path:
    """A checkpoint folder, or the weights file inside one of an older ember."""
    return folder if is_checkpoint(folder) else folder / "model.safetensors"


def vocabulary_size(tok: Tokenizer) -> int:
    return max(tok.get_vocab_size(), max(tok.get_vocab().values(), default=-1) + 1)


def open_run(checkpoint: str | Path, tokenizer: str | Path | None = None) -> Run:
    """Everything evaluation and export need from a run, checked before any compute."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(f"--checkpoint {path} is not a folder; pass the --out folder of `ember train`.")
    run_dir, weights = _locate(path)
    config = load_config(run_dir / "config.toml")
    if config.model.vocab_size < 1:
        raise ConfigError(f"{run_dir}/config.toml has no resolved model.vocab_size; it was not written by a run.")
    tok_path = Path(tokenizer) if tokenizer is not None else run_dir / "tokenizer.json"
    if tokenizer is None and not tok_path.is_file():
        raise ConfigError(f"{run_dir} has no tokenizer.json; copy the tokenizer.json of the data the run was "
                          "trained on (data.json names its folder) into it.")
    tok = load_tokenizer(tok_path)
    tok_file = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
    vocab = vocabulary_size(tok)
    if vocab > config.model.vocab_size:
        fix = ("pass the run's own tokenizer with --tokenizer" if tokenizer is not None else
               "copy the tokenizer.json of the data the run was trained on (data.json names its folder) back into it")
        raise ConfigError(f"the tokenizer {tok_file} has {vocab} tokens but the model was trained on a "
                          f"vocabulary of {config.model.vocab_size}; {fix}.")
    data_path = run_dir / "data.json"
    try:
        data = json.loads(data_path.read_text(encoding="utf-8")) if data_path.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if not isinstance(data, dict):
        raise ConfigError(f"{data_path} is damaged (not a JSON table); it records the data the run was trained "
                          "on: delete it to go on without checking the tokenizer against it.")
    trained_with = data.get("tokenizer_sha256")
    if trained_with and tokenizer_sha256(tok_file) != trained_with:
        # Same size, other tokens: every score would be silently meaningless.
        raise ConfigError(f"the tokenizer {tok_file} is not the one the run was trained with (its sha256 "
                          f"differs from {data_path}); leave out --tokenizer to use the run's own.")
    return Run(run_dir, config, weights, tok_file, tok, special_token_ids(tok), data)
