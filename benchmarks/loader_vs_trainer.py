"""Is the data loader ever the bottleneck? The loader alone against the trainer, same data.

    PYTHONPATH=src python benchmarks/loader_vs_trainer.py \
        --out benchmarks/results/DATE-loader-vs-trainer-cpu.txt

On one prepared folder (by default the built-in corpus, byte-level BPE with 8,192 tokens,
rows of 128, prepared into `--work`) and for each recipe (`configs/tiny-gpt.toml`,
`configs/tiny-bert.toml`):

- loader: what the trainer does on the host for every step, alone: `Batches.next` of the
  recipe's global batch, `make_targets` with the recipe's objective and masking, and the
  count of targets; repeated for `--loader-seconds`;
- trainer: `Trainer.run` of the recipe for a steps budget (about 20-30 s each on a
  quiet 2-core CPU; `--budget` sets one for both), with no evaluation or checkpoint
  inside the budget. Its tokens/s is reported twice: the median of the logged windows
  after the first (steady state), and tokens over the whole run's clock.

The ratio loader / trainer (steady state) says how many times faster the data arrives
than training consumes it; its inverse is the share of a step the data would cost if it
were not overlapped with anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"tiny-gpt": "60steps", "tiny-bert": "15steps"}  # recipe: default training budget


def prepared_data(work: Path) -> Path:
    from ember.data import prepare, write_stdlib_corpus

    out = work / "data"
    if not (out / "manifest.json").exists():
        write_stdlib_corpus(work / "stdlib.jsonl")
        prepare([work / "stdlib.jsonl"], out, tokenizer="bpe", vocab_size=8192, seq_len=128,
                val_fraction=0.01, progress=False, workers=os.cpu_count() or 1)
    return out


def loader_tokens_per_s(data_dir: Path, recipe: str, seconds: float) -> tuple[float, int]:
    from ember.config import load_config
    from ember.data import Batches, load_manifest, make_targets

    cfg = load_config(REPO / "configs" / f"{recipe}.toml")
    m = load_manifest(data_dir)
    batch, seq_len = cfg.train.global_batch, int(m["seq_len"])
    data = Batches(data_dir, m, "train", seed=cfg.data.seed)
    data.next(batch)  # first touch of the memory map, as the trainer's first step has
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        first_row = data.position
        _, labels = make_targets(data.next(batch).ids, cfg.model.objective, cfg.data, m["special_tokens"],
                                      m["vocab_size"], cfg.data.seed, first_row)
        int((labels != -100).sum())  # the trainer counts targets on the host too
        steps += 1
    return steps * batch * seq_len / (time.perf_counter() - start), batch


def trainer_tokens_per_s(data_dir: Path, recipe: str, budget: str, run_dir: Path) -> dict:
    from ember.config import load_config
    from ember.train.trainer import Trainer

    sets = ["train.eval_every=1000000steps", "train.checkpoint_every=1000000steps", "train.log_every=2"]
    cfg = load_config(REPO / "configs" / f"{recipe}.toml", sets)
    summary = Trainer(cfg, data_dir, run_dir, budget=budget, progress=False).run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    windows = windows[1:] or windows  # the first window holds the warm-up
    return {"steady": statistics.median(windows), "overall": summary["tokens_per_s"],
            "steps": summary["steps"], "seconds": summary["elapsed_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="a prepared folder (default: prepare the built-in corpus)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--budget", help="training budget of each recipe (default 60steps gpt, 15steps bert)")
    parser.add_argument("--loader-seconds", type=float, default=3.0, help="loader time per recipe")
    parser.add_argument("--out", type=Path, help="write the results here as well")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    work = args.work or Path(tempfile.mkdtemp(prefix="ember-loader-"))
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    load_start = os.getloadavg()
    data_dir = args.data or prepared_data(work)

    rows = []
    for recipe, budget in RECIPES.items():
        loader, batch = loader_tokens_per_s(data_dir, recipe, args.loader_seconds)
        trained = trainer_tokens_per_s(data_dir, recipe, args.budget or budget, work / f"run-{recipe}-{time.time_ns()}")
        rows.append((recipe, batch, loader, trained))
        print(f"{recipe}: loader {loader:,.0f} tokens/s, trainer {trained['steady']:,.0f} tokens/s", file=sys.stderr)

    lines = [
        f"# loader alone vs trainer, same data and machine ({started:%Y-%m-%d %H:%M} UTC)",
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, {platform.platform()}",
        "command: PYTHONPATH=src python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]),
        f"load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_start)}, "
        f"at end {os.getloadavg()[0]:.1f} (a shared machine)",
        f"data: {data_dir if args.data else 'built-in corpus, BPE vocabulary 8192, seq_len 128'}; "
        f"loader {args.loader_seconds:g} s per recipe; trainer budget "
        + ", ".join(f"{r} {args.budget or b}" for r, b in RECIPES.items()),
        "loader = Batches.next(global batch) + make_targets + target count, one process, no prefetch",
        "trainer steady = median tokens/s of logged 2-step windows after the first; overall = tokens / run clock",
        "",
        f"{'recipe':<11}{'batch':>6}{'loader tok/s':>15}{'trainer tok/s':>15}{'overall':>10}"
        f"{'train s':>9}{'loader/trainer':>16}{'data share':>12}",
    ]
    for recipe, batch, loader, t in rows:
        lines.append(f"{recipe:<11}{batch:>6}{loader:>15,.0f}{t['steady']:>15,.0f}{t['overall']:>10,.0f}"
                     f"{t['seconds']:>9.1f}{loader / t['steady']:>15,.0f}x{t['steady'] / loader:>11.2%}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
