"""One fine-tuning run of `ember eval glue` (a task and a seed), in this process or in a
pool of `--jobs` processes on the CPU.

A unit carries its encoded examples, so a worker opens only the run (its config and
weights) and never re-reads GLUE files. Every unit seeds torch with its seed before
building the classifier, so its result does not depend on which process ran it or in
what order; with N jobs each process gets cores // N threads (at least one), which is
what lets N small models share the machine instead of fighting over its cores.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from ember.device import autocast_dtype
from ember.eval.finetune import Classifier, Protocol, finetune, predict
from ember.eval.metrics import compute
from ember.eval.run import Run, open_run


@dataclass
class Unit:
    checkpoint: str
    tokenizer: str | None
    task: str  # the task's key (sst2, ...)
    metrics: tuple[str, ...]
    outputs: int  # classes, or 1 for regression
    seed: int
    seeds: int
    train_rows: list[list[int]]
    train_labels: list
    dev: dict[str, tuple[list[list[int]], list]]  # result column -> (rows, labels)
    protocol: Protocol
    device: str


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


class EpochLines:
    """A plain line per epoch on stderr (a log file, a pipe, a batch job, a worker process):
    task, seed, epoch, examples/s, the mean loss and the time this seed has left."""

    def __init__(self, unit: Unit, steps_per_epoch: int):
        self.unit, self.per_epoch, self.start = unit, steps_per_epoch, time.perf_counter()

    def __call__(self, epoch: int, loss_sum: torch.Tensor, steps: int) -> None:
        u, elapsed = self.unit, time.perf_counter() - self.start
        done, epochs = epoch + 1, u.protocol.epochs
        examples = min(done * self.per_epoch * u.protocol.batch_size, done * len(u.train_rows))
        left = elapsed / done * (epochs - done)
        print(f"glue {u.task} seed {u.seed + 1}/{u.seeds} epoch {done}/{epochs}: "
              f"{examples / elapsed:,.0f} examples/s, loss {float(loss_sum) / max(1, steps):.4f}, "
              f"{left / 60:.1f} min left for this seed", file=sys.stderr, flush=True)


def fit_and_score(unit: Unit, run: Run | None = None, on_step=lambda step, loss: None,
                  lines: bool = False) -> dict:
    """Fine-tune one classifier and score it on every dev column of its task."""
    from ember.device import pick_device
    from ember.eval.encode import steps_per_epoch

    started = time.perf_counter()
    run = run or open_run(unit.checkpoint, unit.tokenizer)
    device = pick_device(unit.device)
    amp_dtype = autocast_dtype(run.config.train.precision, device)
    regression, p = unit.outputs == 1, unit.protocol
    torch.manual_seed(unit.seed)  # the head's initialisation and the dropout masks
    model = Classifier(run.build_model(dropout=p.dropout), unit.outputs, p.dropout, p.pooling)
    on_epoch = EpochLines(unit, steps_per_epoch(len(unit.train_rows), p.batch_size)) if lines else None
    loss = finetune(model, unit.train_rows, unit.train_labels, regression, run.special_tokens["pad"], unit.seed, p,
                    device, amp_dtype, on_step=on_step, **({"on_epoch": on_epoch} if on_epoch else {}))
    if not math.isfinite(float(loss)):
        # A diverged model still predicts something; its score would be a number that means nothing.
        # The caller names it once every other run has finished, so their results are kept.
        return {"task": unit.task, "seed": unit.seed, "diverged": float(loss),
                "seconds": time.perf_counter() - started}
    scores = {column: compute(unit.metrics, predict(model, rows, regression, p, device, amp_dtype), labels)
              for column, (rows, labels) in unit.dev.items()}
    return {"task": unit.task, "seed": unit.seed, "metrics": scores, "seconds": time.perf_counter() - started}


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _work(args: tuple[Unit, bool]) -> dict:
    return fit_and_score(args[0], lines=args[1])


def run_parallel(units: list[Unit], jobs: int, lines: bool, finished=None) -> list[dict]:
    """Every unit's result, in the order of `units`; the largest tasks start first.
    `finished(index, result)` is called as each unit finishes, so that finished work can be
    kept before an interruption."""
    threads = max(1, cpu_cores() // jobs)
    order = sorted(range(len(units)), key=lambda i: -len(units[i].train_rows))
    # spawn, not fork: a forked child inherits torch's thread pools in an unusable state.
    context = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(_work, (units[i], lines)): i for i in order}
        results: list = [None] * len(units)
        try:
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                if finished is not None:
                    finished(i, results[i])
            return results
        except BaseException:  # Ctrl-C, SIGTERM, a failed unit: the queued fine-tunes are not wanted
            pool.shutdown(wait=False, cancel_futures=True)
            for process in list((pool._processes or {}).values()):  # no public way to stop running ones
                process.terminate()
            raise
