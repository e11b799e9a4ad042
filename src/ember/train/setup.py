"""What the trainer settles before it builds anything: the resolved configuration, the
agreement of config, data and an existing run (refused in one sentence when they clash),
and the optimizer."""

from __future__ import annotations

import copy
import json
import os
import tomllib
from pathlib import Path

import torch

from ember.atomic import TMP_SUFFIX
from ember.config import Config, ConfigError, OptimConfig
from ember.data.manifest import has_document_boundaries
from ember.device import autocast_dtype
from ember.train import checkpoint


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with no weight decay on norms and biases (every tensor of fewer than 2 dims)."""
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields a tied weight once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=device.type == "cuda")


def resolve(config: Config, manifest: dict, budget: str | None = None) -> Config:
    """The run's configuration with what the data and the command line decide filled in:
    `model.vocab_size = 0` becomes the data's vocabulary, `--budget` replaces
    `train.budget`. A new Config: the caller's is left as it was."""
    cfg = copy.deepcopy(config)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = int(manifest["vocab_size"])
    if budget is not None:
        cfg.train.budget = budget
    return cfg


def check_data_fits(config: Config, manifest: dict) -> None:
    """Refuse a model the prepared data outgrows, or settings the data cannot serve."""
    m = config.model
    data_vocab, seq_len = int(manifest["vocab_size"]), int(manifest["seq_len"])
    if 0 < m.vocab_size < data_vocab:
        raise ConfigError(
            f"model.vocab_size ({m.vocab_size}) is smaller than the data's vocabulary "
            f"({data_vocab}); set model.vocab_size={data_vocab} or 0 to take it from the data."
        )
    if m.max_seq_len < seq_len:
        raise ConfigError(
            f"model.max_seq_len ({m.max_seq_len}) is shorter than the data's sequences "
            f"({seq_len}); set model.max_seq_len={seq_len} or prepare with --seq-len {m.max_seq_len}."
        )
    rows = int(manifest.get("splits", {}).get("train", {}).get("sequences", 0))
    if 0 < rows < config.train.global_batch:
        raise ConfigError(f"train.global_batch ({config.train.global_batch}) is larger than the data's train split "
                          f"({rows} sequences), so every step would repeat rows; lower it or prepare more data.")
    if config.data.order == "curriculum" and "curriculum" not in manifest["splits"]["train"]:
        raise ConfigError("data.order = \"curriculum\" needs data prepared with --curriculum sentence-length, "
                          "which this data was not; prepare it again with that flag or set data.order = \"shuffle\".")
    if m.objective == "mlm" and manifest["special_tokens"].get("mask") is None:
        raise ConfigError("the data's tokenizer has no mask token, so it cannot train a masked LM; "
                          "prepare it with --tokenizer wordpiece or bpe.")
    check_document_mask(config, manifest)


def check_document_mask(config: Config, manifest: dict) -> None:
    """data.document_mask needs the document starts that only --doc-boundaries writes."""
    if config.data.document_mask and not has_document_boundaries(manifest):
        raise ConfigError("data.document_mask=true needs document boundaries, which this data was prepared "
                          "without; prepare it again with --doc-boundaries or set data.document_mask=false.")


# Keys that may change between an interrupted run and its resumption: none changes the
# training step. The layout may (sharded checkpoints are keyed by parameter name, and every
# layout computes the same step), and so may the micro-batch (the same global batch in other
# slices); evaluation, logging, checkpointing and spike handling change what is recorded.
_MAY_CHANGE = {
    *(("data", key) for key in ("verify", "prefetch")),
    *(("train", key) for key in ("budget", "device", "compile", "micro_batch", "log_every", "eval_every",
                                 "eval_batches", "checkpoint_every", "keep_checkpoints", "checkpoint_async",
                                 "timeout_s", "on_spike", "spike_sigma", "spike_window", "trackers", "breakdown")),
    *(("parallel", key) for key in ("dp_replicate", "dp_shard", "zero", "tp", "sp", "pp",
                                    "vpp", "schedule", "recompute", "recompute_every", "stage_layers",
                                    "grad_dtype"))}


def _same_on(device: torch.device | None, section: str, key: str, old, new) -> bool:
    """Whether two precisions are one on `device`: "auto" is fp32 on a CPU, so a run
    recorded with "auto" resumes with "fp32" there (as the planner's command spells it)."""
    if (section, key) != ("train", "precision") or device is None:
        return False
    try:
        return autocast_dtype(old, device) == autocast_dtype(new, device)
    except ConfigError:  # a precision this device cannot run is refused where it is chosen
        return False


def check_resume_config(config: Config, saved_path: Path, device: torch.device | None = None) -> None:
    """A resumed run must be the same run: refuse changes that would alter its losses.
    Settings the `device` resolves (train.precision) are compared as resolved."""
    if not saved_path.exists():
        return
    try:
        saved = tomllib.loads(saved_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{saved_path} is damaged ({err}); it records the run being resumed, so restore it "
                          "or start a new run in another --out.") from None
    for section, values in config.to_dict().items():
        for key, value in values.items():
            if (section, key) in _MAY_CHANGE:
                continue
            old = saved.get(section, {}).get(key)
            if old is not None and old != value and not _same_on(device, section, key, old, value):
                raise ConfigError(
                    f"{section}.{key} is {value!r} but the run being resumed used {old!r}; "
                    f"resume with the same setting or start a new run in another --out."
                )


def check_resume_data(manifest: dict, saved_path: Path) -> None:
    """A resumed run must read the same rows: data made with the same tokenizer, cut into
    sequences of the same length (the saved data position counts rows)."""
    if not saved_path.exists():
        return
    try:
        saved = json.loads(saved_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        saved = None
    if not isinstance(saved, dict):
        raise ConfigError(f"{saved_path} is damaged (not JSON); it records the data the run was trained on, "
                          "so the run cannot be resumed safely: start a new run in another --out.")
    if saved.get("tokenizer_sha256") and saved["tokenizer_sha256"] != manifest.get("tokenizer_sha256"):
        raise ConfigError("--data was prepared with another tokenizer than the run being resumed; "
                          "resume with the run's own data or start a new run in another --out.")
    if saved.get("seq_len") and int(saved["seq_len"]) != int(manifest["seq_len"]):
        raise ConfigError(f"--data holds sequences of {manifest['seq_len']} tokens but the run being resumed "
                          f"trained on {saved['seq_len']}; resume with the run's own data or start a new run "
                          "in another --out.")


# What `ember train` writes into a run directory: a folder holding anything else is not a run.
# (Hidden files, and the `.tmp` names of writes a crash cut short, are not counted either way.)
RUN_FILES = {"config.toml", "data.json", "tokenizer.json", "metrics.jsonl", "checkpoints", "summary.json",
             "model.safetensors", "loss.png", "throughput.png", "eval", "tensorboard", "wandb", "wandb_id",
             "trackio"}


def check_run_dir(config: Config, manifest: dict, run_dir: Path, resume: bool,
                  device: torch.device | None = None) -> Path | None:
    """The checkpoint to resume from (None for a fresh run). A run directory that already
    holds a run is never restarted without --resume, a resumed run must be the same run,
    and a folder that holds other files is never written into."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is a file; give a folder for the run.")
    present = ({p.name for p in run_dir.iterdir() if not p.name.startswith(".") and not p.name.endswith(TMP_SUFFIX)}
               if run_dir.is_dir() else set())
    if present - RUN_FILES:
        raise ConfigError(f"--out {run_dir} holds files that are not an ember run "
                          f"({', '.join(sorted(present - RUN_FILES)[:3])}); give a new or empty folder.")
    newest = checkpoint.latest(run_dir)
    if not resume:
        if present:
            raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out.")
        return None
    saves = run_dir / "checkpoints"
    if saves.is_dir() and not os.access(saves, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write checkpoints into {saves} (not writable); fix its permissions first.")
    if newest is None:
        _check_nothing_reached(run_dir)
    if newest is not None:
        check_resume_data(manifest, run_dir / "data.json")  # first: other data also changes the vocabulary
        check_resume_config(config, run_dir / "config.toml", device)
    return newest


def _check_nothing_reached(run_dir: Path) -> None:
    """--resume with no checkpoint starts the run from step 0: right for a job killed before
    its first checkpoint, and after a loss spike before any (its checkpoints set aside
    `.after-spike` hold the spiked weights). Not when the run got further than that: a
    finished model, or checkpoints a user set aside as damaged, would be overwritten."""
    saves = run_dir / "checkpoints"
    reached = [p.name for p in saves.glob("*.damaged")] if saves.is_dir() else []
    if (run_dir / "model.safetensors").is_file():
        reached.append("model.safetensors")
    if reached:
        raise ConfigError(f"{run_dir} holds a run that got further ({', '.join(sorted(reached)[:3])}) but no intact "
                          "checkpoint to resume from; start again with another --out, so that nothing is overwritten.")


def finished_summary(run_dir: Path, newest: Path | None, done) -> dict | None:
    """The summary of a run that `--resume` finds already finished: its newest checkpoint is
    at the end of the budget (`done(progress)`) and the model file and summary of that
    step were written. None where there is training, or finishing, left to do."""
    if newest is None:
        return None
    progress = checkpoint.read_state(newest)["progress"]
    if not done(progress) or not (run_dir / "model.safetensors").is_file():
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if summary.get("status") != "finished" or summary.get("steps") != progress.get("step"):
        return None
    return summary | {"status": "already finished", "run_dir": str(run_dir)}  # where it is now, if it was moved


def check_budget_left(newest: Path | None, budget, done) -> None:
    """Refuse to resume an unfinished run with a budget its newest checkpoint has already
    spent (`done(progress)`): the loop would not run, and the run would be written up as
    finished from weights its schedule never annealed. With the budget the checkpoint was
    saved under, a run stopped after its last step but before its model file was written is
    finished instead, as it would have been."""
    if newest is None:
        return
    state = checkpoint.read_state(newest)
    progress = state["progress"]
    if not done(progress) or state.get("budget") == str(budget):
        return
    at = f"step {progress['step']:,}"
    if budget.kind == "tokens":
        at += f" ({progress['tokens']:,} tokens)"
    elif budget.kind == "seconds":
        at += f" ({progress['elapsed_s']:.0f}s of training)"
    raise ConfigError(f"the run is already at {at}, which uses up the budget of {budget}; give a larger --budget "
                      "to go on.")
