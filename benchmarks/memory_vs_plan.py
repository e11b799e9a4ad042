"""Measured peak memory per rank beside `ember plan`'s prediction, layout by layout.

Each layout trains a Llama-shaped model (configs/llama-1b.toml, shortened to fit this
machine: see --layers, --seq-len) for a few steps under torchrun on this machine's CPU, in
fp32. Every rank measures how far its resident memory rose above where it stood once the
process group existed (the kernel's high-water mark, reset there), i.e. everything
building the model and training it held at the peak. The planner predicts the same run
with fp32 states and activations and no runtime reserve (`ember.plan.memory` with
precision="fp32" on a "GPU" that is this host). The table gives both and their ratio.

    python benchmarks/memory_vs_plan.py                      # all layouts, ~15 minutes on 2 cores
    python benchmarks/memory_vs_plan.py --layouts one,zero3x2 --steps 2

The output goes to results/DATE-memory-vs-plan-cpu.{json,txt}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

LAYOUTS = {
    "one": (1, []),
    "zero1x2": (2, ["parallel.zero=1"]),
    "zero2x2": (2, ["parallel.zero=2"]),
    "zero3x2": (2, ["parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "one-selective": (1, ["parallel.recompute=selective"]),
    "tp2-selective": (2, ["parallel.tp=2", "parallel.recompute=selective"]),
    "tp2-sp-selective": (2, ["parallel.tp=2", "parallel.sp=true", "parallel.recompute=selective"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2"]),
    "pp2xzero3x2": (4, ["parallel.pp=2", "parallel.zero=3"]),
    # The schedules differ in how many micro-batches' activations a stage holds at its peak.
    "pp2-gpipe": (2, ["parallel.pp=2", "parallel.schedule=gpipe"]),
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.vpp=2"]),
    "pp2-zero-bubble": (2, ["parallel.pp=2", "parallel.schedule=zero_bubble", "parallel.vpp=2"]),
    "pp2-zbv": (2, ["parallel.pp=2", "parallel.schedule=zbv", "parallel.vpp=2"]),
}


def worker(data: str, out: str, sets: list[str], steps: int) -> None:
    """One rank: build as `ember train` does and train `steps` steps, then report the peak."""
    import torch

    from ember.config import load_config
    from ember.device import peak_memory_bytes, reset_peak_memory, resident_bytes
    from ember.parallel.mesh import init_distributed
    from ember.train.trainer import Trainer
    import ember.train.trainer as trainer_module

    cfg = load_config(REPO / "configs/llama-1b.toml", sets)
    trainer = Trainer(cfg, Path(data), Path(out) / "run", progress=False)
    if trainer.world > 1:
        init_distributed(trainer.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // trainer.world))
    before = resident_bytes()
    reset_peak_memory(trainer.device)
    trainer_module.reset_peak_memory = lambda device: None  # keep the build inside the peak
    trainer.build()
    for _ in range(steps):
        loss, _, _ = trainer.train_step(cfg.train.global_batch, lr=1e-4)
    rise = peak_memory_bytes(trainer.device) - before
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
               for part in trainer.engine.parts for p in part.parameters())
    Path(out, f"rank{trainer.rank}.json").write_text(json.dumps(
        {"rank": trainer.rank, "peak_rise": rise, "params_bytes": held, "loss": float(loss)}))
    if trainer.world > 1:
        # Torn down by interpreter exit instead, gloo's threads can abort the process while
        # they still hold work (SIGABRT, "terminate called without an active exception").
        from ember.process import end_process_group

        end_process_group()


def prediction(name: str, world: int, sets: list[str]) -> list[dict]:
    """The planner's memory for every pipeline rank of the run `sets` describes."""
    from dataclasses import replace

    from ember.config import load_config
    from ember.layout import Layout
    from ember.plan.layout import TrainShape
    from ember.plan.memory import GIB as PLAN_GIB, stage_memory
    from ember.plan.models import from_config
    from ember.plan.stacks import STACKS, run_stack

    cfg = load_config(REPO / "configs/llama-1b.toml", sets)
    layout = Layout.from_config(cfg, world)
    spec = from_config(cfg.model, "llama-1b-short")
    shape = TrainShape(cfg.model.max_seq_len, cfg.train.global_batch, precision="fp32")
    # ember's trainer as it runs the recipe on this CPU (uncompiled: eager composites).
    stack = run_stack(replace(STACKS["ember"], host_overlaps=False), cfg, "cpu")
    out = []
    for stage in range(layout.pp):
        mem = stage_memory(spec, layout, shape, stage, 4, "flash", 24 * PLAN_GIB, runtime=0.0,
                           stack=stack)
        out.append({"stage": stage, "total": mem.total, "parts_gib": mem.parts_gib()})
    return out


def run(args, data: Path, name: str, nproc: int, sets: list[str], out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", str(data), str(out), str(args.steps), *sets]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def prepare_data(folder: Path, seq_len: int) -> Path:
    corpus, data = folder / "stdlib.jsonl", folder / "data"
    ember = [sys.executable, "-m", "ember"]
    subprocess.run(ember + ["data", "corpus", "--out", str(corpus)], check=True, capture_output=True)
    subprocess.run(ember + ["data", "prepare", str(corpus), "--out", str(data), "--tokenizer", "bpe",
                            "--vocab-size", "4096", "--seq-len", str(seq_len)], check=True, capture_output=True)
    return data


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[5:], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--layers", type=int, default=8, help="layers of the llama-1b shape (22 in full)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    common = [f"model.layers={args.layers}", f"model.max_seq_len={args.seq_len}", "model.vocab_size=32000",
              "train.device=cpu", "train.precision=fp32", "train.compile=false", "train.micro_batch=1",
              f"train.global_batch={args.global_batch}", "parallel.schedule=1f1b"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(Path(tmp), args.seq_len)
        for name in names:
            nproc, sets = LAYOUTS[name]
            measured = run(args, data, name, nproc, common + sets, Path(tmp) / name)
            predicted = prediction(name, nproc, common + sets)
            for m in measured:
                stage = 0 if "parallel.pp=2" not in sets else m["rank"] // (nproc // 2)  # pp is outermost
                p = predicted[stage]
                rows.append({"layout": name, "rank": m["rank"], "measured_gib": m["peak_rise"] / GIB,
                             "predicted_gib": p["total"] / GIB, "ratio": m["peak_rise"] / p["total"],
                             "params_gib": m["params_bytes"] / GIB, "predicted_parts_gib": p["parts_gib"]})
                print(_line(rows[-1]), flush=True)
    one = [r["measured_gib"] for r in rows if r["layout"] == "one"]
    lines = [f"memory vs plan: llama-1b shape with {args.layers} layers, seq {args.seq_len}, global batch "
             f"{args.global_batch}, micro-batch 1, fp32 on CPU ({os.cpu_count()} cores), {args.steps} steps; "
             f"{datetime.date.today()}", f"command: python benchmarks/memory_vs_plan.py {' '.join(sys.argv[1:])}",
             "measured = peak resident memory above the process (after imports and the process group) per rank; "
             "predicted = ember.plan.memory for the same run with fp32 states and activations, no runtime reserve",
             ""] + [_line(r) + (f"  vs one process {r['measured_gib'] / one[0]:.2f}x" if one else "") for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    stamp = f"{datetime.date.today()}-memory-vs-plan-cpu"
    results = REPO / "benchmarks/results"
    (results / f"{stamp}.txt").write_text(text)
    (results / f"{stamp}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def _line(r: dict) -> str:
    return (f"{r['layout']:>15} rank {r['rank']}: measured {r['measured_gib']:6.2f} GiB  predicted "
            f"{r['predicted_gib']:6.2f} GiB  ratio {r['ratio']:.2f}  (parameters held {r['params_gib']:.2f} GiB)")


if __name__ == "__main__":
    main()
