"""The training loop on one device: budget-keyed schedules, gradient accumulation,
held-out evaluation, checkpoints, clean stops on SIGINT/SIGTERM and exact resume."""

from __future__ import annotations

import json
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ember.config import Budget, Config, ConfigError, parse_budget, parse_interval, to_toml
from ember.data import Batches, held_out_seed, load_manifest, make_targets
from ember.model import Transformer
from ember.plan.cost import model_flops_per_token
from ember.train import checkpoint as ckpt
from ember.train.device import (autocast, autocast_dtype, device_name, device_peak_flops,
                                pick_device, synchronize)
from ember.train.metrics import MetricsLog, ProgressBar
from ember.train.schedule import Progress, batch_size, lr_factor
from ember.train.setup import build_optimizer, check_data_fits, check_resume_config, check_resume_data


class _StopFlag:
    """Turns SIGINT/SIGTERM into a request to save and stop at the next step boundary;
    a second signal falls back to the default behaviour."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signum
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Trainer:
    def __init__(self, config: Config, data_dir: Path, run_dir: Path, budget: str | None = None,
                 resume: bool = False, progress: bool = True, model: torch.nn.Module | None = None):
        """`model` trains a given module (same forward signature as `Transformer`) in
        place of the one `config.model` describes; FLOPs are still counted from it."""
        self.cfg = config
        self._given_model = model
        self.data_dir, self.run_dir = Path(data_dir), Path(run_dir)
        if budget is not None:
            config.train.budget = budget
        self.budget: Budget = parse_budget(config.train.budget)
        self.eval_every = parse_interval(config.train.eval_every, "train.eval_every")
        self.ckpt_every = parse_interval(config.train.checkpoint_every, "train.checkpoint_every")
        self.manifest = load_manifest(self.data_dir)
        check_data_fits(config, self.manifest)
        self.seq_len = int(self.manifest["seq_len"])

        self.resume_from = ckpt.latest_checkpoint(self.run_dir) if resume else None
        if not resume and (ckpt.latest_checkpoint(self.run_dir) or (self.run_dir / "metrics.jsonl").exists()):
            raise ConfigError(f"{self.run_dir} already holds a run; pass --resume to continue it or choose another --out.")
        if self.resume_from is not None:
            check_resume_config(config, self.run_dir / "config.toml")
            check_resume_data(self.manifest, self.run_dir / "data.json")

        self.device = pick_device(config.train.device)
        self.amp_dtype = autocast_dtype(config.train.precision, self.device)
        if self.amp_dtype is not None and self.device.type == "cpu":
            raise ConfigError("train.precision=bf16 is for GPUs; use fp32 or auto on a CPU.")
        self.show_progress = progress
        self.stopped_by: int | None = None  # the signal that stopped the run, if any

    # ---- pieces -------------------------------------------------------------------

    def build(self) -> None:
        """Model, optimizer and data; `run` calls it, tools that drive steps themselves too."""
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        model = self._given_model if self._given_model is not None else Transformer(cfg.model)
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.train_data = Batches(self.data_dir, self.manifest, "train", seed=cfg.data.seed)
        n_val = cfg.train.eval_batches * cfg.train.micro_batch
        self.val_ids = Batches(self.data_dir, self.manifest, "val", seed=cfg.data.seed).fixed(n_val)
        self.peak = device_peak_flops(self.device)

    def _targets(self, ids: torch.Tensor, seed: int, first_row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, labels) on the device, and the number of targets, counted on the host
        so that no step waits for the GPU to report it."""
        inputs, labels = make_targets(ids, self.cfg.model.objective, self.cfg.data,
                                      self.manifest["special_tokens"], self.manifest["vocab_size"], seed, first_row)
        count = int((labels != -100).sum())
        if self.device.type == "cuda":
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True), count

    def _flops_per_token(self, predicted_fraction: float) -> float:
        return model_flops_per_token(self.cfg.model, self.seq_len, predicted_fraction)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per target token over a fixed held-out set with fixed masks."""
        if len(self.val_ids) == 0:
            return float("nan")
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = 0
        mb = self.cfg.train.micro_batch
        for start in range(0, len(self.val_ids), mb):
            inputs, labels, n = self._targets(self.val_ids[start:start + mb],
                                             held_out_seed(self.cfg.data.seed), start)
            with autocast(self.device, self.amp_dtype):
                total += self.forward(inputs, labels, reduction="sum").double()
            count += n
        self.model.train()
        return float(total) / max(count, 1)

    def train_step(self, n_sequences: int, lr: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step over `n_sequences`: returns (mean loss, grad norm, targets)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        first_row = self.train_data.state_dict()["position"]
        # Normalise by the targets of the whole step so accumulation equals one big batch.
        inputs, labels, count = self._targets(self.train_data.next(n_sequences), self.cfg.data.seed, first_row)
        loss_sum = torch.zeros((), device=self.device)
        mb = self.cfg.train.micro_batch
        for start in range(0, n_sequences, mb):
            with autocast(self.device, self.amp_dtype):
                part = self.forward(inputs[start:start + mb], labels[start:start + mb], reduction="sum")
            (part / count).backward()
            loss_sum += part.detach().float()
        clip = self.cfg.optim.clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / count, norm, count  # tensors: read only when logged

    def _record_data(self) -> None:
        """Make the run directory self-contained for evaluation and export: its tokenizer,
        and where its data came from."""
        tokenizer = self.data_dir / self.manifest.get("tokenizer_file", "tokenizer.json")
        if tokenizer.exists():
            shutil.copyfile(tokenizer, self.run_dir / "tokenizer.json")
        data = {"data_dir": str(self.data_dir.resolve()), "tokenizer_sha256": self.manifest.get("tokenizer_sha256"),
                "seq_len": self.seq_len, "vocab_size": self.manifest["vocab_size"],
                "special_tokens": self.manifest["special_tokens"]}
        (self.run_dir / "data.json").write_text(json.dumps(data, indent=1))

    def _state(self, progress: Progress) -> dict[str, Any]:
        return {"progress": asdict(progress), "data": self.train_data.state_dict(),
                "budget": str(self.budget)}

    def _save(self, progress: Progress) -> None:
        ckpt.save_checkpoint(self.run_dir, progress.step, self.model, self.optimizer,
                             self._state(progress), keep=self.cfg.train.keep_checkpoints)

    # ---- the loop -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.build()
        progress = Progress()
        if self.resume_from is not None:
            state = ckpt.load_checkpoint(self.resume_from, self.model, self.optimizer)
            progress = Progress(**state["progress"])
            self.train_data.load_state_dict(state["data"])
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
        self._record_data()
        log = MetricsLog(self.run_dir / "metrics.jsonl",
                         resume_step=progress.step if self.resume_from is not None else None)
        bar = ProgressBar(self.show_progress, f"{self.cfg.model.objective} {self.budget}")
        if self.resume_from is not None:
            bar.print(f"resuming from {self.resume_from} (step {progress.step})")
        try:
            with _StopFlag() as stop:
                status = self._loop(progress, log, bar, stop)
                self.stopped_by = stop.signal
        finally:
            bar.close()
            log.close()
        return self._finish(progress, status)

    def _loop(self, progress: Progress, log: MetricsLog, bar: ProgressBar, stop: _StopFlag) -> str:
        t = self.cfg.train
        start = time.perf_counter() - progress.elapsed_s
        last_eval = last_ckpt = (progress.step, progress.elapsed_s)
        window = {"tokens": 0, "flops": 0.0, "seconds": 0.0}
        self.last_loss = self.last_val = float("nan")
        while progress.fraction(self.budget) < 1.0:
            fraction = progress.fraction(self.budget)
            lr = self.cfg.optim.lr * lr_factor(fraction, self.cfg.schedule)
            n = batch_size(fraction, self.cfg.schedule, t.global_batch, t.micro_batch)
            step_start = time.perf_counter()
            loss, grad_norm, count = self.train_step(n, lr)
            tokens = n * self.seq_len
            progress.step += 1
            progress.tokens += tokens
            window["tokens"] += tokens
            window["flops"] += self._flops_per_token(self._predicted_fraction(count, tokens)) * tokens
            progress.elapsed_s = time.perf_counter() - start
            if progress.step % t.log_every == 0 or progress.fraction(self.budget) >= 1.0:
                synchronize(self.device)  # so the window's time covers the work it queued
                progress.elapsed_s = time.perf_counter() - start
                window["seconds"] += time.perf_counter() - step_start
                self.last_loss = float(loss)
                record = self._record(progress, lr, grad_norm, window)
                log.write(record)
                bar.update(progress.fraction(self.budget), self._bar_stats(record))
                window = {"tokens": 0, "flops": 0.0, "seconds": 0.0}
            else:
                window["seconds"] += time.perf_counter() - step_start
            if self._due(self.eval_every, last_eval, progress):
                self._log_eval(progress, log, bar)
                last_eval = (progress.step, progress.elapsed_s)
                progress.elapsed_s = time.perf_counter() - start
            if stop.signal is not None:
                self._save(progress)
                return "interrupted"
            if self._due(self.ckpt_every, last_ckpt, progress):
                self._save(progress)
                last_ckpt = (progress.step, progress.elapsed_s)
                progress.elapsed_s = time.perf_counter() - start
        if last_eval[0] != progress.step:
            self._log_eval(progress, log, bar)
        self._save(progress)
        return "finished"

    def _predicted_fraction(self, count: int, tokens: int) -> float:
        sparse = self.cfg.model.objective == "mlm" and self.cfg.model.sparse_prediction
        return count / tokens if sparse else 1.0

    @staticmethod
    def _due(interval: Budget, last: tuple[int, float], progress: Progress) -> bool:
        # Step intervals fall on multiples, so a resumed run evaluates where the original did.
        if interval.kind == "steps":
            return progress.step % int(interval.amount) == 0
        return progress.elapsed_s - last[1] >= interval.amount

    def _record(self, progress: Progress, lr: float, grad_norm: torch.Tensor, window: dict) -> dict:
        seconds = max(window["seconds"], 1e-9)
        return {
            "step": progress.step, "tokens": progress.tokens, "elapsed_s": round(progress.elapsed_s, 3),
            "loss": self.last_loss, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": window["tokens"] / seconds,
            "mfu": window["flops"] / seconds / self.peak if self.peak else None,
        }

    @staticmethod
    def _bar_stats(record: dict) -> dict[str, str]:
        stats = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if record["mfu"] is not None:
            stats["MFU"] = f"{100 * record['mfu']:.1f}%"
        return stats

    def _log_eval(self, progress: Progress, log: MetricsLog, bar: ProgressBar) -> None:
        self.last_val = self.evaluate()
        log.write({"step": progress.step, "tokens": progress.tokens,
                   "elapsed_s": round(progress.elapsed_s, 3), "val_loss": self.last_val})

    def _finish(self, progress: Progress, status: str) -> dict[str, Any]:
        from safetensors.torch import save_model

        summary = {
            "status": status, "steps": progress.step, "tokens": progress.tokens,
            "elapsed_s": round(progress.elapsed_s, 2), "train_loss": self.last_loss,
            "val_loss": self.last_val, "unigram_entropy": self.manifest.get("unigram_entropy"),
            "tokens_per_s": progress.tokens / max(progress.elapsed_s, 1e-9),
            "device": device_name(self.device), "run_dir": str(self.run_dir),
        }
        if status == "finished":
            tmp = self.run_dir / "model.safetensors.tmp"
            save_model(self.model, str(tmp))
            tmp.replace(self.run_dir / "model.safetensors")
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(self.run_dir / "summary.json")
        return summary
