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
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ember.config import ConfigError
from ember.atomic import write_text
from ember.eval.encode import encode_split
from ember.eval.finetune import Protocol, total_steps
from ember.eval.glue_jobs import Unit, fit_and_score, run_parallel
from ember.eval.glue_tasks import COLUMNS, TASKS, TaskData, load_task, parse_tasks
from ember.eval.results import check_glue_setup, claim, weights_stamp
from ember.eval.run import Run, open_run
from ember.device import device_name, pick_device

CONVENTION = ("each metric is the median over seeds; a column's score is the mean of its metrics "
              "(MRPC, QQP: F1 and accuracy; STS-B: Pearson and Spearman); MNLI-m and MNLI-mm are "
              "separate columns; the average is the unweighted mean over the columns run, WNLI excluded")
METRIC_NAMES = {"accuracy": "acc", "f1": "F1", "matthews": "MCC", "pearson": "Pearson", "spearman": "Spearman"}


def results_path(run: Run, out: str | Path | None) -> Path:
    if out is None:
        return run.result_path("eval/glue", "results")
    out = Path(out)
    # An existing file is the file --out names, whatever its suffix: claim() then judges it,
    # where taking it for a folder could only fail on results.json inside it.
    if out.suffix == ".json" or (out.exists() and not out.is_dir()):
        return out
    return out / "results.json"


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
    """One progress bar per task, counting optimizer steps over all its seeds, in a
    terminal; elsewhere (a log file, a pipe, a batch job) and with --jobs, a plain line
    per epoch of each seed instead (`glue_jobs.EpochLines`)."""

    def __init__(self, enabled: bool, jobs: int = 1):
        self.lines = enabled and (jobs > 1 or not sys.stderr.isatty())
        self.progress = Progress(TextColumn("[bold]{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), disable=not enabled or self.lines)

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def step(self, bar, step: int, loss: torch.Tensor) -> None:
        if self.progress.disable:
            return
        # Reading the loss waits for the device: only every 25 steps.
        fields = {"loss": f"loss {float(loss):.3f}"} if step % 25 == 0 else {}
        self.progress.update(bar, advance=1, **fields)


def task_units(run: Run, data: TaskData, seeds: int, protocol: Protocol, checkpoint: str,
               tokenizer: str | None, device: str) -> list[Unit]:
    """The task's examples encoded once, and one fine-tuning unit per seed."""
    max_len = min(protocol.max_len, run.config.model.max_seq_len)

    def encode(split):
        return encode_split(split, run.tokenizer, run.special_tokens, run.objective, max_len)

    train_rows = encode(data.train)
    dev = {column: (encode(split), split.labels) for column, split in data.dev.items()}
    task = data.task
    outputs = 1 if task.classes is None else len(task.classes)
    return [Unit(checkpoint, tokenizer, task.key, task.metrics, outputs, seed, seeds, train_rows,
                 data.train.labels, dev, protocol, device) for seed in range(seeds)]


def task_result(data: TaskData, done: list[dict], steps: int) -> dict:
    per_seed = [d["metrics"] for d in sorted(done, key=lambda d: d["seed"])]
    return {"metrics": aggregate(per_seed), "per_seed": per_seed, "train_examples": len(data.train),
            "dev_examples": {column: len(split) for column, split in data.dev.items()},
            "skipped_rows": data.train.skipped + sum(s.skipped for s in data.dev.values()),
            "steps_per_seed": steps, "seconds": round(sum(d["seconds"] for d in done), 2)}


def pooling_name(objective: str, pooling: str) -> str:
    if pooling == "mean":
        return "mean"
    return "first token" if objective == "mlm" else "last token"


def run_glue(checkpoint: str | Path, glue_dir: str | Path, tasks: str | None = None, seeds: int = 5,
             tokenizer: str | Path | None = None, out: str | Path | None = None, device: str = "auto",
             progress: bool = True, protocol: Protocol = Protocol(), jobs: int = 1) -> dict:
    """Fine-tune and score every requested task; write and return the results. `jobs` > 1
    runs that many fine-tuning runs (tasks and seeds) at once in processes on the CPU."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, not {seeds}; the protocol's median is over 5.")
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, not {jobs}.")
    run = open_run(checkpoint, tokenizer)
    chosen = parse_tasks(tasks)
    data = [load_task(Path(glue_dir), task) for task in chosen]  # every file checked before any compute
    target = results_path(run, out)
    earlier = claim(target, run.run_dir, "glue")
    dev = pick_device(device, "--device")
    if jobs > 1 and dev.type != "cpu":
        raise ConfigError(f"--jobs {jobs} runs fine-tuning processes on the CPU; on {device_name(dev)} "
                          "use --jobs 1 (or --device cpu).")
    results = {
        "checkpoint": str(run.run_dir), "weights": str(run.weights),
        "weights_stamp": weights_stamp(run.weights), "tokenizer": str(run.tokenizer_path),
        "objective": run.objective, "pooling": pooling_name(run.objective, protocol.pooling),
        "protocol": protocol.to_dict() | {"max_len": min(protocol.max_len, run.config.model.max_seq_len)},
        "seeds": list(range(seeds)), "glue_dir": str(Path(glue_dir).resolve()), "device": device_name(dev),
        "jobs": jobs, "convention": CONVENTION,
        "tasks": {},
    }
    if earlier is not None:
        check_glue_setup(target, earlier, results)
    tok = None if tokenizer is None else str(tokenizer)
    units = [task_units(run, d, seeds, protocol, str(checkpoint), tok, str(dev)) for d in data]
    found = {} if earlier is None else dict(earlier["tasks"])  # tasks run before and not again are kept

    def keep(d, rows: list[dict], steps: int) -> None:
        """A task's score, written at once: an interruption keeps the tasks already done."""
        if not any("diverged" in r for r in rows):
            found[d.task.key] = task_result(d, rows, steps)
            _write(results, found, target)

    with _Bars(progress, jobs) as bars:
        if jobs > 1:
            owner = [k for k, task in enumerate(units) for _ in task]
            got: list[list[dict]] = [[] for _ in units]

            def finished(i: int, result: dict) -> None:  # a task is kept once all its seeds are in
                k = owner[i]
                got[k].append(result)
                if len(got[k]) == len(units[k]):
                    keep(data[k], sorted(got[k], key=lambda r: r["seed"]),
                         total_steps(len(units[k][0].train_rows), protocol))

            flat = run_parallel([u for task in units for u in task], jobs, bars.lines, finished)
            done = {d.task.key: [r for r in flat if r["task"] == d.task.key] for d in data}
        else:
            done = {}
            for d, task in zip(data, units):
                steps = total_steps(len(task[0].train_rows), protocol)
                bar = bars.progress.add_task(d.task.key, total=seeds * steps, loss="")
                done[d.task.key] = []
                for unit in task:
                    bars.progress.update(bar, description=f"{d.task.key} seed {unit.seed + 1}/{seeds}")
                    done[d.task.key].append(fit_and_score(
                        unit, run, lambda step, loss, bar=bar: bars.step(bar, step, loss), bars.lines))
                    if "diverged" in done[d.task.key][-1]:
                        break  # the task has no score; its other seeds would not give it one
                keep(d, done[d.task.key], steps)
    if found:  # the earlier tasks too, where none of this run's finished
        _write(results, found, target)
    diverged = [r for task in done.values() for r in task if "diverged" in r]
    if diverged:
        first = diverged[0]
        kept = f" (the scores of {', '.join(results['tasks'])} are in {target})" if results["tasks"] else ""
        raise ConfigError(f"fine-tuning {first['task']} (seed {first['seed']}) diverged: its last epoch's loss is "
                          f"{first['diverged']}; try a lower --lr than {protocol.lr:g}{kept}.")
    return results


def _write(results: dict, found: dict, target: Path) -> None:
    results["tasks"] = {key: found[key] for key in TASKS if key in found}
    results["columns"] = column_scores(results["tasks"])
    results["average"] = sum(results["columns"].values()) / len(results["columns"])
    results["complete"] = list(results["columns"]) == list(COLUMNS)
    write_text(target, json.dumps(results, indent=1))
    results["path"] = str(target)


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
