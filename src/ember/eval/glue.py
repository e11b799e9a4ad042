"""`ember eval glue`: fine-tune a run's encoder on each GLUE task over several seeds and
report the official metrics, their medians and the average the paper tables use.

Convention (also written into results.json): each metric is the median over seeds; a
result column's score is the mean of its metrics where it has two (F1 and accuracy for
MRPC and QQP, Pearson and Spearman for STS-B); MNLI-m and MNLI-mm are separate columns;
the average is the unweighted mean over columns, WNLI excluded. Metrics are stored as
fractions (correlations in [-1, 1]); the table shows them x100.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ember.config import ConfigError
from ember.atomic import write_text
from ember.eval.encode import encode_split, steps_per_epoch
from ember.eval.finetune import Classifier, Protocol, finetune, predict, total_steps
from ember.eval.glue_tasks import COLUMNS, TaskData, load_task, parse_tasks
from ember.eval.metrics import compute
from ember.eval.run import Run, open_run
from ember.device import autocast_dtype, device_name, pick_device

CONVENTION = ("each metric is the median over seeds; a column's score is the mean of its metrics "
              "(MRPC, QQP: F1 and accuracy; STS-B: Pearson and Spearman); MNLI-m and MNLI-mm are "
              "separate columns; the average is the unweighted mean over the columns run, WNLI excluded")
METRIC_NAMES = {"accuracy": "acc", "f1": "F1", "matthews": "MCC", "pearson": "Pearson", "spearman": "Spearman"}


def results_path(run: Run, out: str | Path | None) -> Path:
    if out is None:
        return run.run_dir / "eval" / "glue" / "results.json"
    out = Path(out)
    return out if out.suffix == ".json" else out / "results.json"


def aggregate(per_seed: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """{column: {metric: value}} per seed -> the median of every metric over seeds."""
    return {column: {metric: statistics.median(seed[column][metric] for seed in per_seed)
                     for metric in metrics}
            for column, metrics in per_seed[0].items()}


def column_scores(tasks: dict) -> dict[str, float]:
    """Each result column's score, in the paper's column order."""
    found = {column: sum(m.values()) / len(m) for task in tasks.values() for column, m in task["metrics"].items()}
    return {column: found[column] for column in COLUMNS if column in found}


class _Bars:
    """One progress bar per task, counting optimizer steps over all its seeds; when stderr
    is not a terminal (a log file, a pipe, a batch job), a plain line per epoch instead:
    task, seed, epoch, examples/s and the time the task has left."""

    def __init__(self, enabled: bool):
        self.plain = enabled and not sys.stderr.isatty()
        self.progress = Progress(TextColumn("[bold]{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), disable=not enabled or self.plain)
        self.tasks: dict = {}

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def add(self, key: str, seeds: int, steps: int, per_epoch: int, batch_size: int, epochs: int):
        bar = self.progress.add_task(key, total=seeds * steps, loss="")
        self.tasks[bar] = {"key": key, "seeds": seeds, "total": seeds * steps, "per_epoch": per_epoch,
                           "batch": batch_size, "epochs": epochs, "done": 0, "start": time.perf_counter()}
        return bar

    def step(self, bar, step: int, loss: torch.Tensor) -> None:
        # Reading the loss waits for the GPU: only every 25 steps.
        fields = {"loss": f"loss {float(loss):.3f}"} if step % 25 == 0 else {}
        self.progress.update(bar, advance=1, **fields)
        t = self.tasks[bar]
        t["done"] += 1
        if self.plain and t["done"] % t["per_epoch"] == 0:
            elapsed = time.perf_counter() - t["start"]
            epochs_done = t["done"] // t["per_epoch"]
            seed, epoch = divmod(epochs_done - 1, t["epochs"])
            left = elapsed / t["done"] * (t["total"] - t["done"])
            print(f"glue {t['key']} seed {seed + 1}/{t['seeds']} epoch {epoch + 1}/{t['epochs']}: "
                  f"{t['done'] * t['batch'] / elapsed:,.0f} examples/s, {left / 60:.1f} min left for {t['key']}",
                  file=sys.stderr, flush=True)


def run_task(run: Run, data: TaskData, seeds: int, protocol: Protocol, device: torch.device,
             bars: _Bars) -> dict:
    task, started = data.task, time.perf_counter()
    max_len = min(protocol.max_len, run.config.model.max_seq_len)

    def encode(split):
        return encode_split(split, run.tokenizer, run.special_tokens, run.objective, max_len)

    train_rows = encode(data.train)
    dev_rows = {column: encode(split) for column, split in data.dev.items()}
    regression = task.classes is None
    amp_dtype = autocast_dtype(run.config.train.precision, device)
    steps = total_steps(len(train_rows), protocol)
    bar = bars.add(task.key, seeds, steps, steps_per_epoch(len(train_rows), protocol.batch_size),
                   protocol.batch_size, protocol.epochs)
    per_seed = []
    for seed in range(seeds):
        bars.progress.update(bar, description=f"{task.key} seed {seed + 1}/{seeds}")
        torch.manual_seed(seed)  # the head's initialisation and the dropout masks
        model = Classifier(run.build_model(dropout=protocol.dropout), 1 if regression else len(task.classes),
                           protocol.dropout)
        finetune(model, train_rows, data.train.labels, regression, run.special_tokens["pad"], seed, protocol,
                 device, amp_dtype, on_step=lambda step, loss: bars.step(bar, step, loss))
        per_seed.append({column: compute(task.metrics, predict(model, rows, regression, protocol, device, amp_dtype),
                                         data.dev[column].labels)
                         for column, rows in dev_rows.items()})
        del model
    return {"metrics": aggregate(per_seed), "per_seed": per_seed, "train_examples": len(data.train),
            "dev_examples": {column: len(split) for column, split in data.dev.items()},
            "skipped_rows": data.train.skipped + sum(s.skipped for s in data.dev.values()),
            "steps_per_seed": steps, "seconds": round(time.perf_counter() - started, 2)}


def run_glue(checkpoint: str | Path, glue_dir: str | Path, tasks: str | None = None, seeds: int = 5,
             tokenizer: str | Path | None = None, out: str | Path | None = None, device: str = "auto",
             progress: bool = True, protocol: Protocol = Protocol()) -> dict:
    """Fine-tune and score every requested task; write and return the results."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, not {seeds}; the protocol's median is over 5.")
    run = open_run(checkpoint, tokenizer)
    chosen = parse_tasks(tasks)
    data = [load_task(Path(glue_dir), task) for task in chosen]  # every file checked before any compute
    target = results_path(run, out)
    dev = pick_device(device)
    results = {
        "checkpoint": str(run.run_dir), "weights": str(run.weights), "tokenizer": str(run.tokenizer_path),
        "objective": run.objective, "pooling": "first token" if run.objective == "mlm" else "last token",
        "protocol": protocol.to_dict() | {"max_len": min(protocol.max_len, run.config.model.max_seq_len)},
        "seeds": list(range(seeds)), "device": device_name(dev), "convention": CONVENTION, "tasks": {},
    }
    with _Bars(progress) as bars:
        for task_data in data:
            results["tasks"][task_data.task.key] = run_task(run, task_data, seeds, protocol, dev, bars)
    results["columns"] = column_scores(results["tasks"])
    results["average"] = sum(results["columns"].values()) / len(results["columns"])
    results["complete"] = list(results["columns"]) == list(COLUMNS)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text(target, json.dumps(results, indent=1))
    results["path"] = str(target)
    return results


def results_table(results: dict) -> Table:
    n = len(results["seeds"])
    table = Table(title=f"GLUE dev, median of {n} seed{'s' * (n > 1)} ({results['objective']}, "
                        f"{results['pooling']} pooling)")
    for name, justify in (("task", "left"), ("metrics", "left"), ("score", "right")):
        table.add_column(name, justify=justify)
    metrics = {column: m for task in results["tasks"].values() for column, m in task["metrics"].items()}
    for column, score in results["columns"].items():
        shown = " / ".join(f"{METRIC_NAMES[k]} {100 * v:.1f}" for k, v in metrics[column].items())
        table.add_row(column, shown, f"{100 * score:.1f}")
    count = len(results["columns"])
    label = "average" if results["complete"] else f"average of {count} column{'s' * (count > 1)}"
    table.add_row(f"[bold]{label}", "", f"[bold]{100 * results['average']:.1f}")
    return table
