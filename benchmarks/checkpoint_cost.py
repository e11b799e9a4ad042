"""What a checkpoint costs the training loop: the same steps of the same ~300M-parameter
model trained without a save, with a synchronous save and with an asynchronous one
(`train.checkpoint_async`), each variant in its own process through ember's Trainer.

Reported per variant: the median step time, the time the save call blocks the loop, and
the loop's total time over the steps against the no-save run (what the save really cost,
including a background writer competing for the CPU or the disk).

    python benchmarks/checkpoint_cost.py                       # 24 x 1024 GPT (~0.3B), CPU
    python benchmarks/checkpoint_cost.py --steps 12 --out benchmarks/results/DATE-checkpoint-cost-cpu.txt
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.hidden=1024", "model.layers=24", "model.heads=16", "model.mlp_hidden=2816",
         "model.max_seq_len=128", "train.micro_batch=1", "train.global_batch=1", "train.device=cpu",
         "train.precision=fp32", "train.compile=false", "train.log_every=1000", "data.prefetch=false"]


def worker(variant: str, data: Path, run_dir: Path, steps: int, save_after: int) -> dict:
    from ember.config import load_config
    from ember.train.schedule import Progress
    from ember.train.trainer import Trainer

    sets = MODEL + [f"train.checkpoint_async={'true' if variant == 'async' else 'false'}"]
    trainer = Trainer(load_config(REPO / "configs/tiny-gpt.toml", sets), data, run_dir, progress=False)
    trainer.build()
    params = sum(p.numel() for p in trainer.model.parameters())
    trainer.train_step(1, 1e-4)  # warm-up: allocator, optimizer states
    times, blocked = [], 0.0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        trainer.train_step(1, 1e-4)
        times.append(time.perf_counter() - t0)
        if variant != "none" and step == save_after:
            t0 = time.perf_counter()
            trainer.save(Progress(step=step))
            blocked = time.perf_counter() - t0
    trainer.checkpointer.wait()  # a write still running is part of the cost
    total = time.perf_counter() - start
    trainer.release()
    hashed = {}
    if variant == "sync":  # the share of the save that checksums take: hashing the folder again
        from ember.train import checksums
        from ember.train.checkpoint import latest

        folder = latest(run_dir)
        t0 = time.perf_counter()
        checksums.write(folder)
        hashed = {"hash_s": time.perf_counter() - t0,
                  "checkpoint_gb": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9}
    return {"variant": variant, "params": params, "median_step_s": statistics.median(times),
            "save_blocks_s": blocked, "total_s": total, **hashed}


def prepared(work: Path) -> Path:
    demo = REPO / "data/demo"
    if (demo / "manifest.json").exists():
        return demo
    from ember.data.corpus import write_stdlib_corpus
    from ember.data.prepare import prepare

    corpus = work / "corpus.jsonl"
    write_stdlib_corpus(corpus)
    prepare([corpus], work / "data", tokenizer="bpe", vocab_size=4096, seq_len=128, progress=False)
    return work / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-after", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # variant data run_dir
    args = parser.parse_args()
    if args.worker:
        variant, data, run_dir = args.worker
        print(json.dumps(worker(variant, Path(data), Path(run_dir), args.steps, args.save_after)))
        return
    load = os.getloadavg()[0]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="ember-ckpt-") as tmp:
        data = prepared(Path(tmp))
        for variant in ("none", "sync", "async"):
            cmd = [sys.executable, __file__, "--steps", str(args.steps), "--save-after", str(args.save_after),
                   "--worker", variant, str(data), str(Path(tmp) / variant)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows[variant] = json.loads(done.stdout.strip().splitlines()[-1])
            print(rows[variant], flush=True)
    base = rows["none"]
    lines = [f"checkpoint cost, {datetime.date.today()}: GPT 24 x 1024 ({base['params'] / 1e6:.0f}M parameters), "
             f"fp32, batch 1 x 128, AdamW, CPU ({os.cpu_count()} cores), {args.steps} steps, one save after step "
             f"{args.save_after}; load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end",
             f"{'variant':<8}{'median step s':>15}{'save blocks s':>15}{'loop total s':>14}{'added by save s':>17}"]
    for name, r in rows.items():
        added = r["total_s"] - base["total_s"]
        lines.append(f"{name:<8}{r['median_step_s']:>15.2f}{r['save_blocks_s']:>15.2f}{r['total_s']:>14.2f}"
                     f"{added:>17.2f}")
    sync_added = rows["sync"]["total_s"] - base["total_s"]
    async_added = rows["async"]["total_s"] - base["total_s"]
    lines.append(f"asynchronous / synchronous: the call blocks "
                 f"{rows['async']['save_blocks_s'] / max(rows['sync']['save_blocks_s'], 1e-9):.2f}x as long, "
                 f"the loop loses {async_added / sync_added if sync_added > 0 else float('nan'):.2f}x as much time")
    sync = rows["sync"]
    lines.append(f"of the synchronous save, its sha256 checksums (checksums.json) took {sync['hash_s']:.2f} s "
                 f"for {sync['checkpoint_gb']:.2f} GB ({sync['checkpoint_gb'] / sync['hash_s']:.2f} GB/s), "
                 "measured by hashing the written folder again")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
