"""GLUE on a CPU in minutes: does a tiny masked LM pretrained for a fixed budget beat the
same shape not pretrained, and how long does each task take?

    python benchmarks/glue_cpu.py --out benchmarks/results/DATE-glue-cpu.txt

1. Pretrain: the built-in corpus (`ember data corpus`: the standard library's docstrings)
   and, by default (`--corpus builtin+glue`), the unlabeled training sentences of the
   tasks (task-adaptive pretraining: text only, no label, no dev example); byte-level BPE
   of `--vocab` tokens, rows of `--seq-len`, then `configs/tiny-bert.toml` at the shape
   `--shape` sets for `--pretrain` (a fixed wall-clock budget). The built-in corpus alone
   (594k tokens of docstrings, seen 18 times in 6 minutes) teaches a model little about
   GLUE's English: it gained 0.2 points.
2. Fine-tune with `ember eval glue`'s protocol (5 epochs, batch 16, lr 4e-5, one seed by
   default; `--pooling mean` by default, since a briefly pretrained masked LM has learned
   nothing at its first position) on the real GLUE files in `--glue-dir` (CoLA, SST-2,
   MRPC, STS-B, RTE; by default ../shared/glue beside the repository) for the pretrained
   run and for a run of the same shape, tokenizer and config whose weights are freshly
   initialised.
3. Step path: milliseconds per fine-tuning step with AdamW's fused kernel against its
   loop over tensors (`Protocol.fused`), same model, data and order, side by side.

It prints per-task scores (x100) for both, the average, and minutes per task (the
fine-tuning run's own wall clock; with `--jobs N` runs overlap, so the total wall clock
is printed too). `--dry-run` does all of it at toy sizes on whatever `--glue-dir` holds
(the test runs it on made-up files). The machine is shared: `uptime`'s load is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = "cola,sst2,mrpc,stsb,rte"
SHAPE = "model.hidden=128,model.layers=2,model.heads=2,model.mlp_hidden=512"
CORPUS, POOLING = "builtin+glue", "mean"
CORPUS_NAMES = {"builtin": "the built-in corpus (the standard library's docstrings)",
                "builtin+glue": "the built-in corpus and the unlabeled training sentences of the tasks"}


def unlabeled_glue(glue_dir: Path, tasks: str, corpus: Path) -> int:
    """Append the training sentences of `tasks` to `corpus`, one document per example (a
    pair's two sentences on two lines): their text only, never a label, never a dev set."""
    from ember.eval.glue_tasks import load_task, parse_tasks

    count = 0
    with corpus.open("a") as f:
        for task in parse_tasks(tasks):
            train = load_task(glue_dir, task).train
            for i, a in enumerate(train.text_a):
                text = a if train.text_b is None else f"{a}\n{train.text_b[i]}"
                f.write(json.dumps({"text": text}) + "\n")
                count += 1
    return count


def prepared_data(work: Path, vocab: int, seq_len: int, dry: bool, glue_text: tuple[Path, str] | None) -> Path:
    from ember.data import prepare, write_stdlib_corpus

    out = work / "data"
    if not (out / "manifest.json").exists():
        corpus = work / "corpus.jsonl"
        write_stdlib_corpus(corpus)
        if dry:  # a slice of the corpus is enough to exercise the path
            corpus.write_text("".join(corpus.read_text().splitlines(keepends=True)[:800]))
        if glue_text:
            unlabeled_glue(*glue_text, corpus)
        prepare([corpus], out, tokenizer="bpe", vocab_size=vocab, seq_len=seq_len, val_fraction=0.01,
                progress=False, workers=os.cpu_count() or 1)
    return out


def pretrain(data: Path, out: Path, shape: list[str], budget: str, seq_len: int) -> dict:
    from ember.config import load_config
    from ember.train.trainer import Trainer

    sets = shape + [f"model.max_seq_len={seq_len}", f"train.budget={budget}", "train.eval_every=1000000steps",
                    "train.checkpoint_every=1000000steps", "train.log_every=50"]
    cfg = load_config(REPO / "configs" / "tiny-bert.toml", sets)
    return Trainer(cfg, data, out, progress=False).run()


def not_pretrained(run: Path, out: Path, seed: int = 0) -> Path:
    """The run's folder with freshly initialised weights: same shape, tokenizer and config."""
    import torch
    from safetensors.torch import save_model

    from ember.eval.run import open_run
    from ember.model import Transformer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("config.toml", "tokenizer.json", "data.json"):
        if (run / name).exists():
            shutil.copyfile(run / name, out / name)
    torch.manual_seed(seed)
    save_model(Transformer(open_run(run).config.model), str(out / "model.safetensors"))
    return out


def step_ms(run: Path, glue_dir: Path, steps: int) -> dict[str, float]:
    """ms per fine-tuning step on SST-2's first examples: fused AdamW against the loop."""
    import torch

    from ember.device import pick_device
    from ember.eval.encode import encode_split
    from ember.eval.finetune import Classifier, Protocol, finetune
    from ember.eval.glue_tasks import TASKS, load_task
    from ember.eval.run import open_run

    r = open_run(run)
    split = load_task(glue_dir, TASKS["sst2"]).train
    rows = encode_split(split, r.tokenizer, r.special_tokens, "mlm", min(128, r.config.model.max_seq_len))
    n = steps * 16  # one epoch of `steps` steps
    out = {}
    for name, fused in (("foreach AdamW", False), ("fused AdamW", True)):
        torch.manual_seed(0)
        model = Classifier(r.build_model(dropout=0.1), 2, 0.1)
        start = time.perf_counter()
        finetune(model, rows[:n], split.labels[:n], False, r.special_tokens["pad"], 0,
                 Protocol(epochs=1, fused=fused), pick_device("cpu"), None)
        out[name] = 1000 * (time.perf_counter() - start) / steps
    return out


def score_lines(name: str, results: dict) -> list[str]:
    lines = []
    for key, task in results["tasks"].items():
        for column, metrics in task["metrics"].items():
            shown = " / ".join(f"{k} {100 * v:.1f}" for k, v in metrics.items())
            lines.append(f"  {name:<15} {column:<6} {100 * results['columns'][column]:6.1f}   {shown:<34} "
                         f"{task['seconds'] / 60:5.2f} min ({task['train_examples']:,} train examples)")
    lines.append(f"  {name:<15} {'average':<6} {100 * results['average']:6.1f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--glue-dir", type=Path, default=REPO.parent / "shared" / "glue")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2, help="fine-tuning processes at once (ember eval glue --jobs)")
    parser.add_argument("--pretrain", default="6m", help="pretraining budget (a train.budget value)")
    parser.add_argument("--shape", default=SHAPE, help="comma-separated model.* settings over tiny-bert.toml")
    parser.add_argument("--corpus", choices=("builtin", "builtin+glue"), default=CORPUS,
                        help="pretraining text: the built-in corpus, and with +glue the unlabeled training "
                             "sentences of --tasks (task-adaptive pretraining; no labels, no dev sets)")
    parser.add_argument("--pooling", choices=("auto", "mean"), default=POOLING, help="ember eval glue --pooling")
    parser.add_argument("--lr", type=float, default=4e-5, help="fine-tuning peak learning rate (ember eval glue --lr)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--step-steps", type=int, default=150, help="steps per side of the step-path comparison")
    parser.add_argument("--work", type=Path, help="working folder (default: a new temporary one)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--json", type=Path, help="also write the scores and minutes here")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, to check that everything runs")
    args = parser.parse_args()
    if not (args.glue_dir / "SST-2").is_dir():
        print(f"benchmarks/glue_cpu.py: no GLUE files in {args.glue_dir}; pass --glue-dir.", file=sys.stderr)
        return 2
    if args.dry_run:
        args.pretrain, args.vocab, args.seq_len, args.step_steps = "20steps", 512, 64, 3
        args.shape = "model.hidden=32,model.layers=1,model.heads=2,model.mlp_hidden=64"

    from ember.eval.finetune import Protocol
    from ember.eval.glue import run_glue

    work = args.work or Path(tempfile.mkdtemp(prefix="ember-glue-cpu-"))
    work.mkdir(parents=True, exist_ok=True)
    started, load_start, clock = datetime.now(UTC), os.getloadavg(), time.perf_counter()
    shape = [s for s in args.shape.split(",") if s]
    glue_text = (args.glue_dir, args.tasks) if args.corpus == "builtin+glue" else None
    data = prepared_data(work, args.vocab, args.seq_len, args.dry_run, glue_text)
    t = time.perf_counter()
    summary = pretrain(data, work / "pretrained", shape, args.pretrain, args.seq_len)
    pretrain_min = (time.perf_counter() - t) / 60
    scratch = not_pretrained(work / "pretrained", work / "scratch")
    protocol = Protocol(epochs=1 if args.dry_run else Protocol.epochs, lr=args.lr, pooling=args.pooling)
    results, walls = {}, {}
    for name, run in (("pretrained", work / "pretrained"), ("not pretrained", scratch)):
        t = time.perf_counter()
        results[name] = run_glue(run, args.glue_dir, tasks=args.tasks, seeds=args.seeds, out=work / f"{name}.json",
                                 device="cpu", jobs=args.jobs, protocol=protocol)
        walls[name] = (time.perf_counter() - t) / 60
    steps = step_ms(work / "pretrained", args.glue_dir, args.step_steps)

    import torch

    lines = [
        f"# GLUE on a CPU: a tiny masked LM pretrained for {args.pretrain} vs the same shape not pretrained "
        f"({started:%Y-%m-%d %H:%M} UTC){' [DRY RUN: toy sizes]' if args.dry_run else ''}",
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_start)}, at end "
        f"{os.getloadavg()[0]:.1f} (a shared machine)",
        "command: python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]),
        f"model: configs/tiny-bert.toml with {args.shape}, "
        f"seq {args.seq_len}, BPE {args.vocab}; corpus: {CORPUS_NAMES[args.corpus]}; "
        f"pretraining {pretrain_min:.1f} min, "
        f"{summary['steps']} steps, final train loss {summary['train_loss']:.3f}",
        f"fine-tuning: ember eval glue's protocol ({protocol.epochs} epochs, batch {protocol.batch_size}, "
        f"lr {protocol.lr:g}, {results['pretrained']['pooling']} pooling), {args.seeds} seed(s), "
        f"--jobs {args.jobs}, GLUE dev sets from {args.glue_dir}",
        "",
        f"  {'model':<15} {'column':<6} {'score':>6}   {'metrics':<34} minutes per task",
    ]
    for name in results:
        lines += score_lines(name, results[name])
    gains = [results["pretrained"]["columns"][c] - results["not pretrained"]["columns"][c]
             for c in results["pretrained"]["columns"]]
    lines += ["", f"average gain from pretraining: {100 * statistics.mean(gains):+.1f} points "
                  f"({sum(g > 0 for g in gains)} of {len(gains)} columns better)",
              "wall clock: " + ", ".join(f"{name} {m:.1f} min" for name, m in walls.items())
              + f"; whole benchmark {(time.perf_counter() - clock) / 60:.1f} min",
              f"fine-tuning step on SST-2 (batch 16, {args.step_steps} steps, {torch.get_num_threads()} threads): "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in steps.items())]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({
            "average": {name: r["average"] for name, r in results.items()},
            "columns": {name: r["columns"] for name, r in results.items()},
            "task_minutes": {name: {k: t["seconds"] / 60 for k, t in r["tasks"].items()}
                             for name, r in results.items()},
            "wall_minutes": walls, "pretrain_minutes": pretrain_min, "step_ms": steps}, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
