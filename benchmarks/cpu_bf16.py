"""bf16 autocast against fp32 on a CPU, end to end through `ember train`: the same model,
data, steps and seed in each precision; tokens/s and held-out loss of each, and the ratio.

CPUs with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake) or AMX (Intel Sapphire Rapids and
later) multiply bf16 matrices about twice as fast as fp32; whether a whole training step
gains, and whether the loss stays as good, is what this measures.

    python benchmarks/cpu_bf16.py                      # the demo's 4 x 192 GPT and a 6 x 384 GPT
    python benchmarks/cpu_bf16.py --steps 300 --out benchmarks/results/DATE-cpu-bf16.txt

Needs the demo's data (`make data/demo/manifest.json`) or --data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "demo 4 x 192": [],
    "gpt 6 x 384": ["model.hidden=384", "model.layers=6", "model.heads=6", "model.mlp_hidden=1024"],
}


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    return ", ".join(have) or "neither avx512_bf16 nor amx_bf16"


def train(data: Path, out: Path, precision: str, sets: list[str], steps: int) -> dict:
    cmd = [sys.executable, "-m", "ember", "train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(data),
           "--out", str(out), "--budget", f"{steps}steps", "--set", f"train.precision={precision}",
           "--set", f"train.eval_every={steps // 2}steps", "--set", "train.checkpoint_every=100000steps"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO / "data/demo")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    if not (args.data / "manifest.json").exists():
        raise SystemExit(f"no prepared data in {args.data}; run `make data/demo/manifest.json` or pass --data.")
    lines = [f"bf16 autocast vs fp32 on CPU, {datetime.date.today()}: {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores ({cpu_flags()}); {args.steps} steps each of configs/tiny-gpt.toml "
             f"(batch 16 x 128) on {args.data}; load average {os.getloadavg()[0]:.1f} at start",
             f"{'model':<14}{'fp32 tok/s':>12}{'bf16 tok/s':>12}{'speed':>8}{'fp32 val':>10}{'bf16 val':>10}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory(prefix="ember-bf16-") as tmp:
        for name, sets in MODELS.items():
            runs = {p: train(args.data, Path(tmp) / f"{name}-{p}".replace(" ", "_"), p, sets, args.steps)
                    for p in ("fp32", "bf16")}
            f, b = runs["fp32"], runs["bf16"]
            lines.append(f"{name:<14}{f['tokens_per_s']:>12,.0f}{b['tokens_per_s']:>12,.0f}"
                         f"{b['tokens_per_s'] / f['tokens_per_s']:>7.2f}x{f['val_loss']:>10.3f}{b['val_loss']:>10.3f}")
            print(lines[-1], flush=True)
    lines.append(f"load average {os.getloadavg()[0]:.1f} at end; one seed each")
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
