"""The training loop, on one device or under torchrun: budget-keyed schedules, gradient
accumulation, held-out evaluation, checkpoints, clean stops on SIGINT/SIGTERM and exact
resume. The layout's work (data, tensor, pipeline parallelism) lives in an engine from
`ember.parallel`; every rank runs this same loop, and rank 0 alone writes files."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ember.config import Budget, Config, ConfigError, parse_budget, parse_interval, to_toml
from ember.data import Batches, held_out_seed, load_manifest, make_targets
from ember.data.manifest import verify_checksums
from ember.model import Transformer
from ember.parallel.engine import build_engine
from ember.parallel.mesh import Topology, build_mesh, env_world, init_distributed
from ember.parallel.validate import check_layout, check_world
from ember.cost import model_flops_per_token
from ember.train.breakdown import StepProfiler, reduce_over_ranks
from ember.train import checkpoint as ckpt
from ember.train import saving
from ember.device import PhaseTimer, autocast_dtype, device_name, device_peak_flops, pick_device, synchronize
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


class _NoLog:
    """The metrics log of ranks other than 0."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


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
        # The layout is checked before any process group, model or batch exists.
        self.world, self.rank, local_rank = env_world()
        check_layout(config, self.world)
        check_world(self.world, resume, saving.sharded_available())

        self.resume_from = ckpt.latest_checkpoint(self.run_dir) if resume else None
        if not resume and (ckpt.latest_checkpoint(self.run_dir) or (self.run_dir / "metrics.jsonl").exists()):
            raise ConfigError(f"{self.run_dir} already holds a run; pass --resume to continue it or choose another --out.")
        if self.resume_from is not None:
            check_resume_config(config, self.run_dir / "config.toml")
            check_resume_data(self.manifest, self.run_dir / "data.json")

        self.device = pick_device(config.train.device)
        if self.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
        self.amp_dtype = autocast_dtype(config.train.precision, self.device)
        if self.amp_dtype is not None and self.device.type == "cpu":
            raise ConfigError("train.precision=bf16 is for GPUs; use fp32 or auto on a CPU.")
        if config.data.verify:  # last of the checks: the ranks read every shard once between them
            verify_checksums(self.data_dir, self.manifest, self.rank, self.world)
        self.show_progress = progress and self.rank == 0
        self.stopped_by: int | None = None  # the signal that stopped the run, if any

    # ---- pieces -------------------------------------------------------------------

    def build(self) -> None:
        """Model, optimizer and data; `run` calls it, tools that drive steps themselves too."""
        cfg = self.cfg
        self.topo = Topology()
        if self.world > 1:
            init_distributed(self.device)
            self.topo = Topology(self.world, self.rank, build_mesh(cfg.parallel, self.world, self.device.type))
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        model = self._given_model if self._given_model is not None else Transformer(cfg.model)
        self.engine = build_engine(cfg, model.to(self.device), self.topo, self.device, self.amp_dtype,
                                   lambda module: build_optimizer(module, cfg.optim, self.device))
        self.model, self.optimizer = self.engine.parts[0], self.engine.optimizers[0]
        self.timer = self.engine.timer = PhaseTimer(self.device)
        self.profiler = StepProfiler(self.device)
        breakdown = self.cfg.train.breakdown
        self.breakdown = breakdown == "on" or (breakdown == "auto" and self.world > 1)
        self.dp_rank, self.dp_size = self.topo.coordinate("dp"), self.topo.size("dp")
        if self.dp_size > 1:  # dropout: other rows, other draws
            torch.manual_seed(cfg.train.seed + 1 + self.dp_rank)
        docs = cfg.data.document_mask  # then batches are (rows, document ids)
        self.train_data = Batches(self.data_dir, self.manifest, "train", seed=cfg.data.seed,
                                  rank=self.dp_rank, world=self.dp_size, documents=docs,
                                  order=cfg.data.order)
        n_val = cfg.train.eval_batches * cfg.train.micro_batch
        val = Batches(self.data_dir, self.manifest, "val", seed=cfg.data.seed, documents=docs).fixed(n_val)
        self.val_ids, self.val_docs = val if docs else (val, None)
        self.peak = device_peak_flops(self.device)

    def _targets(self, ids: torch.Tensor, seed: int, first_row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, labels) on the device, and the number of targets, counted on the host
        so that no step waits for the GPU to report it."""
        inputs, labels = make_targets(ids, self.cfg.model.objective, self.cfg.data,
                                      self.manifest["special_tokens"], self.manifest["vocab_size"], seed, first_row)
        count = int((labels != -100).sum())
        return self._to_device(inputs), self._to_device(labels), count

    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is not None and self.device.type == "cuda":
            t = t.pin_memory()
        return t if t is None else t.to(self.device, non_blocking=True)

    def _flops_per_token(self, predicted_fraction: float) -> float:
        return model_flops_per_token(self.cfg.model, self.seq_len, predicted_fraction)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per target token over a fixed held-out set with fixed masks."""
        if len(self.val_ids) == 0:
            return float("nan")
        # Every data-parallel rank scores the whole (small) set: the same forwards on every
        # rank keep FSDP's collectives matched, and no sum over dp is needed.
        parts, count = [], 0
        mb = self.cfg.train.micro_batch
        for start in range(0, len(self.val_ids), mb):
            parts.append(self._targets(self.val_ids[start:start + mb], held_out_seed(self.cfg.data.seed), start))
            count += parts[-1][2]
        inputs, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = self.engine.loss_sum(inputs, labels, document_ids=self._to_device(self.val_docs))
        total = self.topo.all_reduce(loss, ("pp",))
        return float(total) / max(count, 1)

    def train_step(self, n_sequences: int, lr: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step over `n_sequences` of the global batch: returns (mean loss,
        grad norm, targets), all over the whole global batch."""
        for optimizer in self.engine.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        # This rank's rows are global rows first_row.. of the step (masks hash the global row).
        first_row = self.train_data.position + self.dp_rank * (n_sequences // self.dp_size)
        batch = self.train_data.next(n_sequences)
        ids, docs = batch if isinstance(batch, tuple) else (batch, None)
        inputs, labels, local = self._targets(ids, self.cfg.data.seed, first_row)
        # Normalise by the targets of the whole global batch, so that accumulation and data
        # parallelism equal one big batch on one device; summed on the host (gloo).
        count = int(self.topo.all_reduce(torch.tensor([local], dtype=torch.int64), ("dp",)))
        timer = self.timer
        with timer.phase("forward_backward"):
            loss_sum = self.engine.forward_backward(inputs, labels, 1.0 / count, document_ids=self._to_device(docs))
        with timer.phase("optimizer"):
            clip = self.cfg.optim.clip
            norm = self.engine.clip_grad_norm(clip if clip > 0 else float("inf"))
            for optimizer in self.engine.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        loss_sum = self.topo.all_reduce(loss_sum, ("dp", "pp"))
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
        saving.save(self, progress.step, self._state(progress))

    # ---- the loop -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.build()
        if self.topo.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        progress = Progress()
        if self.resume_from is not None:
            state = saving.load(self, self.resume_from)
            progress = Progress(**state["progress"])
            self.train_data.load_state_dict(state["data"])
        if self.topo.is_main:
            (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
            self._record_data()
        log = (MetricsLog(self.run_dir / "metrics.jsonl",
                          resume_step=progress.step if self.resume_from is not None else None)
               if self.topo.is_main else _NoLog())
        bar = ProgressBar(self.show_progress, f"{self.cfg.model.objective} {self.budget}")
        if self.resume_from is not None and self.topo.is_main:
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
            # Whole micro-batches on every data-parallel rank, however the ramp rounds.
            n = batch_size(fraction, self.cfg.schedule, t.global_batch, t.micro_batch * self.dp_size)
            step_start = time.perf_counter()
            # Time (and, with train.breakdown, profile) the steps that are logged.
            self.timer.enabled = (progress.step + 1) % t.log_every == 0
            self.profiler.enabled = self.timer.enabled and self.breakdown
            with self.profiler.step():
                loss, grad_norm, count = self.train_step(n, lr)
            tokens = n * self.seq_len
            progress.step += 1
            progress.tokens += tokens
            window["tokens"] += tokens
            window["flops"] += self._flops_per_token(self._predicted_fraction(count, tokens)) * tokens
            progress.elapsed_s = self._agree(time.perf_counter() - start, stop)
            if progress.step % t.log_every == 0 or progress.fraction(self.budget) >= 1.0:
                synchronize(self.device)  # so the window's time covers the work it queued
                if self.world == 1:  # many ranks keep the clock they agreed on
                    progress.elapsed_s = time.perf_counter() - start
                window["seconds"] += time.perf_counter() - step_start
                self.last_loss = float(loss)
                record = (self._record(progress, lr, grad_norm, window) | self.timer.read()
                          | reduce_over_ranks(self.profiler.read(), self.topo))
                log.write(record)
                bar.update(progress.fraction(self.budget), self._bar_stats(record))
                window = {"tokens": 0, "flops": 0.0, "seconds": 0.0}
            else:
                window["seconds"] += time.perf_counter() - step_start
            if self._due(self.eval_every, last_eval, progress):
                self._log_eval(progress, log, bar)
                last_eval = (progress.step, progress.elapsed_s)
                progress.elapsed_s = self._agree(time.perf_counter() - start, stop)
            if stop.signal is not None:
                self._save(progress)
                return "interrupted"
            if self._due(self.ckpt_every, last_ckpt, progress):
                self._save(progress)
                last_ckpt = (progress.step, progress.elapsed_s)
                progress.elapsed_s = self._agree(time.perf_counter() - start, stop)
        if last_eval[0] != progress.step:
            self._log_eval(progress, log, bar)
        self._save(progress)
        return "finished"

    def _agree(self, elapsed: float, stop: _StopFlag) -> float:
        """Ranks must take the same decisions (stop, evaluate, save) at the same step: they
        adopt the slowest rank's clock and stop when any rank was signalled."""
        if self.world == 1:
            return elapsed
        state = torch.tensor([elapsed, 0.0 if stop.signal is None else float(stop.signal)], dtype=torch.float64)
        self.topo.all_reduce(state, ("world",), op=torch.distributed.ReduceOp.MAX)
        if state[1] > 0 and stop.signal is None:
            stop.signal = int(state[1])
        return float(state[0])

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
        summary = {
            "status": status, "steps": progress.step, "tokens": progress.tokens,
            "elapsed_s": round(progress.elapsed_s, 2), "train_loss": self.last_loss,
            "val_loss": self.last_val, "unigram_entropy": self.manifest.get("unigram_entropy"),
            "tokens_per_s": progress.tokens / max(progress.elapsed_s, 1e-9),
            "device": device_name(self.device), "run_dir": str(self.run_dir),
            "world_size": self.world, "peak_memory_gib": round(self.peak_memory_gib(), 3),
        }
        if status == "finished":
            saving.save_model(self, self.run_dir / "model.safetensors")
        if not self.topo.is_main:
            return summary
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(self.run_dir / "summary.json")
        return summary

    def peak_memory_gib(self) -> float:
        """Peak memory of this rank: allocated GPU memory on CUDA, the process's resident
        set elsewhere (Linux reports it in KiB)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
