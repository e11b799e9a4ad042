"""The training loop, on one device or under torchrun: budget-keyed schedules, gradient
accumulation, held-out evaluation, checkpoints, clean stops on SIGINT/SIGTERM and exact
resume. The layout's work (data, tensor, pipeline parallelism) lives in an engine from
`ember.parallel`; every rank runs this same loop, and rank 0 alone writes files.

Everything a run is checked against (config, data, layout, run directory) is settled in
`Trainer.__init__`, before a process group, a model or a batch exists.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ember.atomic import write_text
from ember.budget import parse_budget, parse_interval
from ember.config import Config, to_toml
from ember.cost import model_flops_per_token
from ember.data import Batches, load_manifest
from ember.data.manifest import check_tokenizer, verify_checksums
from ember.layout import check_run
from ember.device import (PhaseTimer, autocast_dtype, device_name, device_peak_flops, peak_memory_bytes,
                          peak_reserved_bytes, pick_device, reset_peak_memory, use_device)
from ember.model import Transformer
from ember.parallel.engine import build_engine
from ember.parallel.mesh import Topology, build_mesh, env_world, init_distributed
from ember.train import checkpoint
from ember.train.breakdown import StepProfiler, profiled, reduce_over_ranks
from ember.train.clock import Clock, Throughput
from ember.train.evaluation import Evaluator, held_out_rows
from ember.train.inputs import Inputs, Prefetcher
from ember.train.loss_scale import LossScaler
from ember.train.metrics import MetricsLog, NoLog, ProgressBar
from ember.train.model_file import save_model
from ember.train.policies import HALT, ROLLBACK, STOP, Every, Policy, SpikeGuard, StepResult, StopOnSignal
from ember.train.schedule import Progress, batch_size, lr_factor
from ember.train.trackers import open_trackers
from ember.train.setup import (build_optimizer, check_budget_left, check_data_fits, check_run_dir, finished_summary,
                               resolve)


class Trainer:
    def __init__(self, config: Config, data_dir: Path, run_dir: Path, budget: str | None = None,
                 resume: bool = False, progress: bool = True, model: torch.nn.Module | None = None):
        """`model` trains a given module (same forward signature as `Transformer`) in
        place of the one `config.model` describes; FLOPs are still counted from it."""
        self.data_dir, self.run_dir = Path(data_dir), Path(run_dir)
        self.manifest = load_manifest(self.data_dir)
        check_data_fits(config, self.manifest)
        self.cfg = cfg = resolve(config, self.manifest, budget)
        self.budget = parse_budget(cfg.train.budget)
        self.seq_len = int(self.manifest["seq_len"])
        self.world, self.rank, local_rank = env_world()
        self.device = pick_device(cfg.train.device)
        self.parallel = check_run(cfg, self.world, self.seq_len, self.device.type)
        self.resume_from = check_run_dir(cfg, self.manifest, self.run_dir, resume, self.device)
        # A requeued job whose run had already finished: nothing to build, write or train.
        def spent(progress: dict) -> bool:
            return Progress(**progress).done(self.budget)

        self.finished = finished_summary(self.run_dir, self.resume_from, spent)
        if self.finished is None:
            check_budget_left(self.resume_from, self.budget, spent)
        if self.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
        use_device(self.device)
        self.amp_dtype = autocast_dtype(cfg.train.precision, self.device)
        check_tokenizer(self.data_dir, self.manifest)
        if cfg.data.verify:  # last of the checks: the ranks read every shard once between them
            verify_checksums(self.data_dir, self.manifest, self.rank, self.world)
        self._given_model = model
        self.resume_requested = resume
        self.show_progress = progress and self.rank == 0
        self.policies: list[Policy] = []  # per-step policies beside the stop on signals
        self.guard = None
        if cfg.train.on_spike != "off":
            self.guard = SpikeGuard(cfg.train.on_spike, cfg.train.spike_sigma, cfg.train.spike_window)
            self.policies.append(self.guard)
        self.stopped_by: int | None = None  # the signal that stopped the run, if any
        self.saved_step: int | None = None  # the step whose state the newest checkpoint holds

    # ---- pieces -------------------------------------------------------------------

    def build(self) -> None:
        """Model, engine, optimizer and data; `run` calls it, tools that drive steps themselves too."""
        cfg = self.cfg
        self.topo = Topology()
        if self.world > 1:
            init_distributed(self.device, cfg.train.timeout_s)
            self.topo = Topology(self.world, self.rank, build_mesh(self.parallel, self.device.type))
        torch.manual_seed(cfg.train.seed)
        if self._given_model is not None:
            model = self._given_model.to(self.device)
        else:
            # Shapes only: every rank allocates its own share once the layout is applied, and
            # initial weights are a function of train.seed and each parameter's name.
            with torch.device("meta"):
                model = Transformer(cfg.model)
        self.engine = build_engine(cfg, self.parallel, model, self.topo, self.device, self.amp_dtype,
                                   lambda module: build_optimizer(module, cfg.optim, self.device))
        self.model, self.optimizer = self.engine.parts[0], self.engine.optimizers[0]
        self.scaler = LossScaler(self.device, self.amp_dtype == torch.float16, all_ranks=self.world > 1)
        self.timer = self.engine.timer = PhaseTimer(self.device)
        self.profiler = StepProfiler(self.device)
        self.dp_rank, self.dp_size = self.topo.coordinate("dp"), self.topo.size("dp")
        if self.dp_size > 1:  # dropout: other rows, other draws
            torch.manual_seed(cfg.train.seed + 1 + self.dp_rank)
        docs = cfg.data.document_mask  # then batches carry document ids
        self.inputs = Inputs(cfg, self.manifest, self.device)
        batches = Batches(self.data_dir, self.manifest, "train", seed=cfg.data.seed,
                          rank=self.dp_rank, world=self.dp_size, documents=docs, order=cfg.data.order)
        self.train_data = Prefetcher(batches, self.inputs, cfg.data.seed, self.dp_rank, self.dp_size,
                                     ahead=cfg.data.prefetch)
        val = Batches(self.data_dir, self.manifest, "val", seed=cfg.data.seed, documents=docs)
        self.eval_rows = held_out_rows(cfg, self.run_dir / "data.json" if self.resume_from is not None else None)
        self.evaluate = Evaluator(cfg, val, self.inputs, self.engine, self.topo, self.eval_rows)
        background = cfg.train.checkpoint_async
        self.checkpointer = checkpoint.Checkpointer(background == "true" or (background == "auto"
                                                                            and self.device.type == "cuda"))
        self.peak = device_peak_flops(self.device)
        reset_peak_memory(self.device)  # what training holds, not what building passed through

    def flops_per_token(self, predicted_fraction: float) -> float:
        return model_flops_per_token(self.cfg.model, self.seq_len, predicted_fraction)

    def train_step(self, n_sequences: int, lr: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step over `n_sequences` of the global batch: returns (mean loss,
        grad norm, targets), all over the whole global batch."""
        for optimizer in self.engine.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        batch = self.train_data.next(n_sequences)
        # Normalise by the targets of the whole global batch, so that accumulation and data
        # parallelism equal one big batch on one device; summed on the host (gloo).
        count = int(self.topo.all_reduce(torch.tensor([batch.count], dtype=torch.int64), ("dp",)))
        # In fp16 the loss is scaled up too (a device tensor), and the gradients back down.
        with self.timer.phase("forward_backward"):
            loss_sum = self.engine.forward_backward(batch.inputs, batch.labels, self.scaler.factor() / count,
                                                    document_ids=batch.document_ids, positions=batch.positions)
        with self.timer.phase("optimizer"):
            self.scaler.unscale(self.engine.optimizers)
            clip = self.cfg.optim.clip
            norm = self.engine.clip_grad_norm(clip if clip > 0 else float("inf"))
            self.scaler.step(self.engine.optimizers)  # skipped on every rank if a gradient overflowed
            for optimizer in self.engine.optimizers:
                optimizer.zero_grad(set_to_none=True)
        loss_sum = self.topo.all_reduce(loss_sum, ("dp", "pp"))
        return loss_sum / count, norm, count  # tensors: read only when logged

    def save(self, progress: Progress) -> None:
        if progress.step == self.saved_step:  # the run's last checkpoint already holds this state
            return
        self.saved_step = progress.step
        state = {"progress": asdict(progress), "data": self.train_data.state_dict(), "budget": str(self.budget)}
        if self.scaler.enabled:
            state["loss_scale"] = self.scaler.state_dict()
        self.checkpointer.save(self.run_dir, progress.step, self.engine.parts, self.engine.optimizers, state,
                               keep=self.cfg.train.keep_checkpoints, layout=self.layout())

    # ---- the run ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        if self.finished is not None:
            return self.finished
        self.build()
        progress = Progress()
        if self.resume_from is not None:
            state = checkpoint.load(self.resume_from, self.engine.parts, self.engine.optimizers, self.layout())
            progress = Progress(**state["progress"])
            self.train_data.load_state_dict(state["data"])
            self.scaler.load_state_dict(state.get("loss_scale"))
            self.saved_step = progress.step
        if self.topo.is_main:
            # Only what the trainer itself writes: `ember report` or `ember eval` may be writing beside it.
            checkpoint.remove_unfinished(self.run_dir, ("config.toml", "data.json", "tokenizer.json", "metrics.jsonl",
                                                        "summary.json", "model.safetensors"))
            self._write_run_files()
        resume_step = progress.step if self.resume_from is not None else None
        log = (MetricsLog(self.run_dir / "metrics.jsonl", resume_step=resume_step,
                          trackers=open_trackers(self.cfg.train.trackers, self.run_dir, to_toml(self.cfg), resume_step))
               if self.topo.is_main else NoLog())
        bar = ProgressBar(self.show_progress, f"{self.cfg.model.objective} {self.budget}")
        data_vocab = int(self.manifest["vocab_size"])
        if self.topo.is_main and self.cfg.model.vocab_size > 2 * data_vocab:  # legal, but rarely meant
            bar.print(f"note: model.vocab_size ({self.cfg.model.vocab_size:,}) is "
                      f"{self.cfg.model.vocab_size / data_vocab:.0f}x the data's vocabulary ({data_vocab:,}): "
                      "the output rows beyond it never see a target; model.vocab_size=0 takes the data's.")
        if self.topo.is_main and self.amp_dtype == torch.float16 and self.device.type == "cpu":
            bar.print("note: train.precision=fp16 on a CPU runs emulated fp16 matmuls, many times slower than fp32; "
                      "it checks an fp16 run (loss scaling, skipped steps) before a GPU without bf16 trains it.")
        if self.resume_from is not None and self.topo.is_main:
            bar.print(f"resuming from {self.resume_from} (step {progress.step})")
        elif self.resume_requested and self.topo.is_main:  # a requeued job that never reached a checkpoint
            bar.print(f"no checkpoint in {self.run_dir} yet: starting the run from step 0")
        try:
            with StopOnSignal() as stop:
                status = self._loop(progress, log, bar, [stop, *self.policies])
                self.stopped_by = stop.signal
        finally:
            self.checkpointer.wait()  # a checkpoint being written is finished, whatever happened
            bar.close()
            log.close()
        return self._finish(progress, status)

    def _loop(self, progress: Progress, log, bar: ProgressBar, policies: list[Policy]) -> str:
        t, stop = self.cfg.train, policies[0]
        clock, throughput = Clock(self.topo, progress.elapsed_s), Throughput(self.device, self.peak)
        self.evaluate.every = Every(parse_interval(t.eval_every, "train.eval_every"), progress)
        checkpoints = Every(parse_interval(t.checkpoint_every, "train.checkpoint_every"), progress)
        self.last_loss, self.last_val, self.last_val_step = float("nan"), float("nan"), None
        # Where the schedule was last read. The time a step is expected to take is the last
        # one's; a step slower than the next (a busy host, a compile) must not send the
        # schedule back.
        read_at = 0.0
        # A step's time runs from the last agreement to this one, less the evaluations and
        # checkpoints between: so it covers the device's catching up at a logged step.
        since = clock.local()
        while not progress.done(self.budget):
            fraction = progress.fraction(self.budget)
            n = batch_size(fraction, self.cfg.schedule, t.global_batch)
            read_at = max(read_at, progress.step_fraction(self.budget, n * self.seq_len, progress.step_s))
            lr = self.cfg.optim.lr * lr_factor(read_at, self.cfg.schedule)
            # Time (and, with train.breakdown, profile) the steps on the logging interval.
            self.timer.enabled = (progress.step + 1) % t.log_every == 0
            self.profiler.enabled = self.timer.enabled and profiled(t.breakdown, self.world,
                                                                    (progress.step + 1) // t.log_every)
            throughput.start()
            with self.profiler.step():
                loss, grad_norm, count = self.train_step(n, lr)
            tokens = n * self.seq_len
            progress.step, progress.tokens = progress.step + 1, progress.tokens + tokens
            progress.elapsed_s, signal, progress.step_s = clock.agree(stop.signal, clock.local() - since)
            since = clock.local()
            logged = progress.step % t.log_every == 0 or progress.done(self.budget)
            throughput.stop(tokens, self.flops_per_token(self._predicted_fraction(count, tokens)) * tokens,
                            synchronise=logged)
            if logged:
                self.last_loss = float(loss)
                record = {"step": progress.step, "tokens": progress.tokens, "elapsed_s": round(progress.elapsed_s, 3),
                          "loss": self.last_loss, "lr": lr, "grad_norm": float(grad_norm), **throughput.read(),
                          **self.scaler.log()}
                log.write(record | self.timer.read() | reduce_over_ranks(self.profiler.read(), self.topo))
                bar.update(1.0 if progress.done(self.budget) else progress.fraction(self.budget), _bar_stats(record))
            held = clock.local()
            if self.evaluate.due(progress):
                self._log_eval(progress, log)
            result = StepResult(progress, signal, loss, logged, self.train_data.position)
            decisions = [policy.after_step(result) for policy in policies]
            if STOP in decisions:
                self.save(progress)
                return "interrupted"
            if HALT in decisions:
                done = self.guard.action == "rollback"  # and it has rolled back as often as it may
                log.write(self._spike_record(progress)
                          | {"action": f"stop: rolled back {self.guard.rollbacks} times already" if done else "stop"})
            if HALT in decisions or (ROLLBACK in decisions and not self._roll_back(progress, log, bar)):
                self.checkpointer.wait()
                checkpoint.set_aside(self.run_dir, self.guard.spike.step)  # --resume starts before the spike
                return "stopped on a loss spike"
            if ROLLBACK in decisions:
                read_at = 0.0  # a step or token budget goes back with the weights
            elif checkpoints.due(progress):
                self.save(progress)
                checkpoints.done(progress)
            since += clock.local() - held
        if self.evaluate.every.last_step != progress.step:
            self._log_eval(progress, log)
        self.save(progress)
        return "finished"

    def _spike_record(self, progress: Progress) -> dict:
        spike = self.guard.spike
        return {"step": progress.step, "event": "loss spike", "spike_step": spike.step,
                "spike_loss": spike.loss if math.isfinite(spike.loss) else str(spike.loss), "reason": spike.reason}

    def _roll_back(self, progress: Progress, log, bar: ProgressBar) -> bool:
        """Load the newest checkpoint before the spike into the running engine and skip the
        data up to the spike (what the BLOOM and OPT teams did by hand). False when there is
        no such checkpoint. The clock keeps running: a time budget counts the lost steps."""
        spike = self.guard.spike
        self.checkpointer.wait()
        before = [p for p in checkpoint.list_checkpoints(self.run_dir) if checkpoint.step_of(p) < spike.step]
        if before:  # so that neither --resume nor the next rollback goes back past the spike
            checkpoint.set_aside(self.run_dir, spike.step)
        record = self._spike_record(progress)
        if not before:
            log.write(record | {"action": "stop: no checkpoint before the spike"})
            if self.topo.is_main:
                bar.print(f"step {spike.step}: {spike.reason}; no checkpoint before it to roll back to, stopping")
            return False
        elapsed = progress.elapsed_s
        state = checkpoint.load(before[-1], self.engine.parts, self.engine.optimizers, self.layout())
        for key, value in state["progress"].items():
            setattr(progress, key, value)
        self.saved_step = progress.step
        progress.elapsed_s = elapsed
        self.train_data.load_state_dict(state["data"])
        self.scaler.load_state_dict(state.get("loss_scale"))
        skipped = spike.data_position - self.train_data.position
        self.train_data.position = spike.data_position
        self.guard.rolled_back()
        log.rewind(progress.step)
        log.write(record | {"action": "rollback", "checkpoint_step": progress.step, "skipped_sequences": skipped})
        if self.topo.is_main:  # once for the run, not once per rank
            bar.print(f"step {spike.step}: {spike.reason}; rolled back to step {progress.step} and skipped "
                      f"{skipped} sequences of data")
        return True

    def _predicted_fraction(self, count: int, tokens: int) -> float:
        sparse = self.cfg.model.objective == "mlm" and self.cfg.model.sparse_prediction
        return count / tokens if sparse else 1.0

    def _log_eval(self, progress: Progress, log) -> None:
        self.last_val, self.last_val_step = self.evaluate(), progress.step
        self.evaluate.every.done(progress)
        log.write({"step": progress.step, "tokens": progress.tokens,
                   "elapsed_s": round(progress.elapsed_s, 3), "val_loss": self.last_val})

    def _write_run_files(self) -> None:
        """The resolved config, and what makes the run directory self-contained for
        evaluation and export: its tokenizer, and where its data came from."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.run_dir / "config.toml", to_toml(self.cfg))
        tokenizer = self.data_dir / self.manifest.get("tokenizer_file", "tokenizer.json")
        if tokenizer.exists():
            shutil.copyfile(tokenizer, self.run_dir / "tokenizer.json")
        data = {"data_dir": str(self.data_dir.resolve()), "tokenizer_sha256": self.manifest.get("tokenizer_sha256"),
                "seq_len": self.seq_len, "vocab_size": self.manifest["vocab_size"],
                "special_tokens": self.manifest["special_tokens"],
                "eval_batches": self.cfg.train.eval_batches, "eval_rows": self.eval_rows}
        write_text(self.run_dir / "data.json", json.dumps(data, indent=1))
        # Until this run ends, a finished run's summary (resumed to train on) would no longer hold.
        write_text(self.run_dir / "summary.json", json.dumps(
            {"status": "running or killed", "run_dir": str(self.run_dir),
             "unigram_entropy": self.manifest.get("unigram_entropy")}, indent=1))

    def _finish(self, progress: Progress, status: str) -> dict[str, Any]:
        summary = {
            "status": status, "steps": progress.step, "tokens": progress.tokens,
            "elapsed_s": round(progress.elapsed_s, 2), "train_loss": self.last_loss,
            "val_loss": self.last_val, "val_step": self.last_val_step,
            "unigram_entropy": self.manifest.get("unigram_entropy"),
            "tokens_per_s": progress.tokens / max(progress.elapsed_s, 1e-9),
            "device": device_name(self.device), "run_dir": str(self.run_dir),
            "world_size": self.world, "peak_memory_gib": round(self.peak_memory_gib(), 3),
            "peak_reserved_gib": round(self.peak_reserved_gib(), 3),
        }
        if status == "finished":
            save_model(self.engine.parts, self.run_dir / "model.safetensors", progress.step)
        if self.topo.is_main:  # a loss never measured (no step logged) is null, not NaN: strict JSON
            finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
            write_text(self.run_dir / "summary.json", json.dumps(finite, indent=1))
        return summary

    def release(self) -> None:
        """Drop the model, engine and data: what holds communication state (pipeline schedules,
        FSDP) goes while the process group it talks over is still alive, not at exit."""
        if getattr(self, "train_data", None) is not None:
            self.train_data.close()
        if getattr(self, "checkpointer", None) is not None:
            self.checkpointer.close()
        self.engine = self.model = self.optimizer = self.evaluate = self.train_data = None
        gc.collect()

    def close(self) -> None:
        """Release the run, then end the process group: every rank waits for the others
        first, so none tears it down while another still talks over it (PyTorch asks for
        destroy_process_group before exit; NCCL otherwise warns, and may leave a peer's
        last collective waiting)."""
        from ember.process import end_process_group

        self.release()
        end_process_group()

    def layout(self) -> dict[str, int]:
        """The parallel degrees that decide which rank draws which random numbers; a
        checkpoint restores RNG streams only into the same degrees."""
        return {**self.parallel.sizes, "vpp": self.parallel.vpp}

    def peak_memory_gib(self) -> float:
        """Peak memory of this rank since the model was built (`ember.device.peak_memory_bytes`)."""
        return peak_memory_bytes(self.device) / 2**30

    def peak_reserved_gib(self) -> float:
        """The same peak as `ember plan` predicts it (`ember.device.peak_reserved_bytes`)."""
        return peak_reserved_bytes(self.device) / 2**30


def _bar_stats(record: dict) -> dict[str, str]:
    stats = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if record["mfu"] is not None:
        stats["MFU"] = f"{100 * record['mfu']:.1f}%"
    return stats
