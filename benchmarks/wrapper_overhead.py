"""What ember's wrappers cost on one device: the same model and data trained for the same
steps plain, under DDP (zero=0) and ZeRO-3 (FSDP2) over a one-rank process group,
compiled per block, and with selective and full recomputation. Tokens/s and peak memory of
each, and their ratio to plain.

Each variant runs in its own process (peak memory is per process, and compile caches and
process groups must not leak between variants) through ember's own Trainer: `build()` and
`train_step()`, the trainer's step with its targets, loss normalisation, clipping and
AdamW. On one device the trainer applies no data-parallel wrapper, so the DDP and ZeRO-3
variants rewrap its model with `apply_data_parallel(..., alone=True)` over a world of one:
what is measured is the wrappers' hooks, copies and collectives on one rank.

    python benchmarks/wrapper_overhead.py                                  # GPU: configs/gpt2-small.toml
    python benchmarks/wrapper_overhead.py --preset tiny --steps 12 --rounds 4 --threads 1   # CPU: a 4 x 64 model
    python benchmarks/wrapper_overhead.py --set train.micro_batch=8 --data data/gpt --variants plain,zero3

Without --data, the tokens are synthetic (uniform over the vocabulary, as a prepared folder):
throughput and memory do not depend on what the tokens say.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from ember.config import load_config  # noqa: E402
from ember.device import device_name, pick_device, synchronize  # noqa: E402

# name -> (extra --set values, data-parallel wrapper: None, or the ZeRO stage)
VARIANTS: dict[str, tuple[list[str], int | None]] = {
    "plain": ([], None),
    "ddp": ([], 0),
    "zero3": ([], 3),
    "compile": (["train.compile=true"], None),
    "selective": (["parallel.recompute=selective"], None),
    "full": (["parallel.recompute=full"], None),
}
PRESETS = {
    "tiny": ["model.hidden=64", "model.layers=4", "model.heads=4", "model.mlp_hidden=256",
             "model.max_seq_len=64", "model.vocab_size=256", "model.vocab_multiple=128",
             "train.micro_batch=8", "train.global_batch=16"],
}
# Measure steps only: no evaluation, checkpoint or logging inside the timed window.
QUIET = ["train.log_every=1000000", "train.eval_every=1000000steps", "train.checkpoint_every=1000000steps"]


def synthetic_data(folder: Path, vocab: int, seq_len: int, sequences: int) -> Path:
    """A prepared folder (ember-shards/1) of uniform random tokens."""
    from ember.data.manifest import FORMAT, file_sha256

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    splits = {}
    for split, rows in (("train", sequences), ("val", 8)):
        name = f"{split}_00000.npy"
        np.save(folder / name, rng.integers(0, vocab, (rows, seq_len)).astype(dtype))
        splits[split] = {"sequences": rows, "tokens": rows * seq_len, "documents": rows,
                         "shards": [{"file": name, "sequences": rows, "sha256": file_sha256(folder / name)}]}
    manifest = {"format": FORMAT, "vocab_size": vocab, "seq_len": seq_len, "dtype": dtype,
                "special_tokens": {"sep": 0}, "splits": splits}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _wrap_data_parallel(trainer, zero: int) -> None:
    """The trainer's model under DDP or FSDP2 over a process group of this one process."""
    from ember.parallel.data import apply_data_parallel
    from ember.parallel.engine import LocalEngine
    from ember.parallel.mesh import Topology, build_mesh, init_distributed
    from ember.train.setup import build_optimizer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    init_distributed(trainer.device)
    topo = Topology(1, 0, build_mesh(trainer.cfg.parallel, 1, trainer.device.type))
    module = trainer.engine.module
    dp = apply_data_parallel(module, topo, zero, trainer.device, trainer.amp_dtype, alone=True)
    # After wrapping, so that the optimizer holds FSDP's sharded parameters.
    optimizer = build_optimizer(module, trainer.cfg.optim, trainer.device)
    trainer.engine = LocalEngine(module, optimizer, trainer.cfg.train.micro_batch, trainer.device,
                                 trainer.amp_dtype, dp)
    trainer.engine.timer = trainer.timer
    trainer.model, trainer.optimizer, trainer.topo = module, optimizer, topo


def run_variant(args: argparse.Namespace) -> dict:
    """One variant in this process; returns its measurements."""
    from ember.train.trainer import Trainer

    sets, zero = VARIANTS[args.one]
    cfg = load_config(args.config, PRESETS.get(args.preset, []) + list(args.set) + sets + QUIET
                      + [f"train.device={args.device}"])
    with tempfile.TemporaryDirectory(prefix="ember-overhead-") as run_dir:
        trainer = Trainer(cfg, Path(args.data), Path(run_dir) / "run", progress=False)
        trainer.build()
        if zero is not None:
            _wrap_data_parallel(trainer, zero)
        rows, lr = cfg.train.global_batch, cfg.optim.lr
        for _ in range(args.warmup):  # compilation, allocator and kernel caches
            trainer.train_step(rows, lr)
        synchronize(trainer.device)
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        rss_before = _current_rss_mib()
        # Rounds of steps, each synchronised only at its end (steps overlap as in training);
        # the fastest round is the variant's speed, which discounts other load on the machine.
        per_round = max(1, args.steps // args.rounds)
        rounds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(per_round):
                loss, _, _ = trainer.train_step(rows, lr)
            synchronize(trainer.device)
            rounds.append((time.perf_counter() - start) / per_round)
        loss = float(loss)
    peak = trainer.peak_memory_gib() * 1024  # the trainer's own figure: what summary.json reports
    if trainer.device.type == "cuda":
        memory = {"peak_memory_mib": peak, "memory_kind": "torch.cuda.max_memory_allocated"}
    else:
        memory = {"peak_memory_mib": peak, "memory_kind": "peak RSS of the process",
                  "rss_growth_in_steps_mib": max(0.0, peak - rss_before)}
    tokens = rows * trainer.seq_len
    return {"variant": args.one, "tokens_per_s": tokens / min(rounds), "step_s": min(rounds),
            "step_s_rounds": [round(r, 5) for r in rounds], "last_loss": loss, **memory}


def _child_command(args: argparse.Namespace, variant: str, data: Path) -> list[str]:
    cmd = [sys.executable, __file__, "--one", variant, "--config", str(args.config), "--data", str(data),
           "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--device", args.device, "--threads", str(args.threads)]
    if args.preset:
        cmd += ["--preset", args.preset]
    for item in args.set:
        cmd += ["--set", item]
    return cmd


def table(rows: list[dict]) -> str:
    plain = next((r for r in rows if r["variant"] == "plain" and "error" not in r), None)
    lines = [f"{'variant':10s} {'tokens/s':>12s} {'x plain':>8s} {'step ms':>9s} {'peak MiB':>10s} {'x plain':>8s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:10s} failed: {r['error']}")
            continue
        speed = r["tokens_per_s"] / plain["tokens_per_s"] if plain else float("nan")
        mem = r["peak_memory_mib"] / plain["peak_memory_mib"] if plain else float("nan")
        lines.append(f"{r['variant']:10s} {r['tokens_per_s']:>12,.0f} {speed:>8.3f} {1000 * r['step_s']:>9.1f} "
                     f"{r['peak_memory_mib']:>10,.1f} {mem:>8.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "gpt2-small.toml"))
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a small model for CPUs")
    parser.add_argument("--set", action="append", default=[], help="section.key=value, as for ember train")
    parser.add_argument("--data", help="a prepared folder (default: synthetic tokens)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per variant")
    parser.add_argument("--rounds", type=int, default=5, help="the timed steps in this many rounds; the fastest counts")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads per variant (0: torch's default)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per variant")
    parser.add_argument("--out", help="JSON file (default: benchmarks/results/DATE-wrapper-overhead-DEVICE.json)")
    parser.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.one:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return

    device = pick_device(args.device)
    cfg = load_config(args.config, PRESETS.get(args.preset, []) + list(args.set))
    work = Path(tempfile.mkdtemp(prefix="ember-overhead-data-"))
    data = Path(args.data) if args.data else synthetic_data(
        work / "data", cfg.model.vocab_size or 512, cfg.model.max_seq_len,
        sequences=(args.steps + args.warmup) * cfg.train.global_batch)
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        started = time.perf_counter()
        try:
            done = subprocess.run(_child_command(args, variant, data), capture_output=True, text=True,
                                  timeout=args.timeout)
            result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")),
                          None)
            if result is None:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                result = {"variant": variant, "error": tail[0][:300]}
        except subprocess.TimeoutExpired:
            result = {"variant": variant, "error": f"timed out after {args.timeout:.0f}s"}
        result["wall_s"] = round(time.perf_counter() - started, 1)
        rows.append(result)
        print(table(rows).splitlines()[-1], f"({result['wall_s']}s)", flush=True)

    date = datetime.date.today().isoformat()
    kind = "cpu" if device.type == "cpu" else device.type
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"{date}-wrapper-overhead-{kind}.json"
    report = {
        "date": date, "device": device_name(device), "device_type": device.type,
        "command": " ".join(["python", "benchmarks/wrapper_overhead.py"] + sys.argv[1:]),
        "config": str(Path(args.config).resolve().relative_to(REPO)) if Path(args.config).resolve().is_relative_to(REPO)
        else args.config,
        "preset": args.preset, "overrides": args.set, "data": args.data or "synthetic",
        "model": {k: getattr(cfg.model, k) for k in ("hidden", "layers", "heads", "mlp_hidden", "max_seq_len")},
        "micro_batch": cfg.train.micro_batch, "global_batch": cfg.train.global_batch,
        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "torch": torch.__version__, "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(), "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    header = (f"{date} {report['device']} ({device.type}); {report['command']}\n"
              f"model {report['model']}, micro_batch {report['micro_batch']}, global_batch {report['global_batch']}, "
              f"{args.steps} timed steps in {args.rounds} rounds (fastest round counts) after {args.warmup}; "
              f"{torch.get_num_threads()} CPU threads\n")
    out.with_suffix(".txt").write_text(header + table(rows) + "\n")
    print(f"\n{header}{table(rows)}\nwritten to {out} and {out.with_suffix('.txt')}")


if __name__ == "__main__":
    main()
