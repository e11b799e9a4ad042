"""`ember plan` against measured step time and memory on this machine's CPU, layout by layout.

Tests the structure of the cost model (pipeline bubble, exposed data-parallel and ZeRO
communication, tensor-parallel traffic, recomputation, memory) against reality, which
published rows cannot. Steps:

1. Calibrate this machine: `torchrun --nproc-per-node=2 -m ember plan calibrate --model`
   (gloo), which measures matmul, attention and memory rates, the collectives' bandwidth
   and latency, and the time of every matmul and attention shape the planner prices for
   this model's layouts on up to 4 processes (plan/kernels.py), and writes a profile.
2. For each layout of a small model (configs/tiny-gpt.toml, 1-4 processes): `ember bench
   --profile PROFILE --json` under torchrun, which trains a few steps and prints the
   measured step time and peak memory beside the planner's prediction for that layout.
3. Print predicted against measured step time and memory, the median step-time error,
   and whether the measured fastest layout is in the planner's top two; and the step time
   the planner predicts from its kernel models alone (the profile's measured matmul and
   attention shapes left out), so the two can be compared on the same measurements.

Target (docs/planner.md): median step-time error at most 20%; measured fastest in the top two.
Run it on a quiet machine: other work on the cores makes every timing wrong.

    python benchmarks/planner_vs_measured_cpu.py              # ~10-15 minutes on 2 cores (2 rounds)
    python benchmarks/planner_vs_measured_cpu.py --dry-run    # the commands only

Writes benchmarks/results/<date>-planner-vs-measured-cpu.{txt,json}.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "tiny-gpt.toml"
# Large enough that matmuls, not per-operator host overhead, fill most of a step.
MODEL = ["model.hidden=256", "model.layers=4", "model.heads=4", "model.mlp_hidden=768", "model.max_seq_len=128",
         "train.device=cpu", "train.precision=fp32", "train.compile=false", "train.global_batch=16"]

# name -> (processes, settings). DDP, ZeRO-1/2/3, tensor and pipeline parallelism with five
# schedules, recomputation, and their mixes over 1-4 processes (FSDP under a pipeline too).
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["train.micro_batch=16"]),
    "single-accum4": (1, ["train.micro_batch=4"]),
    "single-recompute": (1, ["train.micro_batch=16", "parallel.recompute=full"]),
    "ddp2": (2, ["train.micro_batch=8", "parallel.zero=0", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "zero1x2": (2, ["train.micro_batch=8", "parallel.zero=1"]),
    "zero2x2": (2, ["train.micro_batch=4", "parallel.zero=2"]),
    "zero3x2": (2, ["train.micro_batch=8", "parallel.zero=3"]),
    "zero3x2-recompute": (2, ["train.micro_batch=8", "parallel.zero=3", "parallel.recompute=full"]),
    "tp2": (2, ["train.micro_batch=16", "parallel.tp=2"]),
    "pp2-1f1b": (2, ["train.micro_batch=4", "parallel.pp=2", "parallel.schedule=1f1b"]),
    "pp2-gpipe": (2, ["train.micro_batch=4", "parallel.pp=2", "parallel.schedule=gpipe"]),
    "pp2-interleaved": (2, ["train.micro_batch=4", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "pp2-zero-bubble": (2, ["train.micro_batch=4", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble"]),
    "pp2-zbv": (2, ["train.micro_batch=4", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv"]),
    "pp2-zero1x2": (4, ["train.micro_batch=4", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=1"]),
    "pp2-zero3x2": (4, ["train.micro_batch=4", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=3"]),
    "ddp4": (4, ["train.micro_batch=4", "parallel.zero=0", "parallel.dp_replicate=4", "parallel.dp_shard=1"]),
    "tp2-zero1x2": (4, ["train.micro_batch=8", "parallel.tp=2", "parallel.zero=1"]),
}


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def calibrate_command(profile: Path, recipe: Path) -> list[str]:
    return torchrun(2) + ["-m", "ember", "plan", "calibrate", "--out", str(profile), "--dtype", "fp32",
                          "--model", str(recipe), "--gpus", "4", "--global-batch", "16"]


def write_recipe(folder: Path, data: Path) -> Path:
    """The benchmark's model as a recipe of its own (the planner needs the vocabulary size,
    which tiny-gpt.toml leaves to the data): what `ember plan calibrate --model` times."""
    from ember.config import load_config, to_toml
    from ember.data.manifest import load_manifest

    vocab = load_manifest(data)["vocab_size"]
    recipe = folder / "model.toml"
    recipe.write_text(to_toml(load_config(RECIPE, MODEL + [f"model.vocab_size={vocab}"])))
    return recipe


def shared_profile(profile: Path, nproc: int, cores: int) -> Path:
    """The profile of a rank when `nproc` processes share `cores` cores: every rate the
    calibration measured (matmul, memory copy, collectives) divided among them, and the
    host's dispatch (per kernel, and eager tensor parallelism's and FSDP2's per layer) as much slower,
    since it runs on the same cores. With one thread per process, a rank is one core when
    nproc <= cores."""
    from ember.plan.calibrate import HOST_FIGURES
    from ember.plan.stacks import STACKS

    if nproc <= cores:
        return profile
    share = cores / nproc
    data = json.loads(profile.read_text())
    for key in ("peak_bf16_flops", "hbm_gbps", "intra_gbps", "inter_gbps"):
        if key in data["gpu"]:
            data["gpu"][key] *= share
    for key in ("intra_gbps", "inter_gbps"):
        if key in data["links"]:
            data["links"][key] *= share
    stack = data.setdefault("stack", {})
    stack["host_s_per_kernel"] = stack.get("host_s_per_kernel", STACKS["ember"].host_s_per_kernel) / share
    for key in HOST_FIGURES:  # eager tensor parallelism's and FSDP2's, per layer
        if key in stack:
            stack[key] /= share
    for section in ("matmuls", "attention"):
        for row in data.get(section, {}).get("times", []):
            row[-1] /= share
    data["source"] += f"; {nproc} processes on {cores} cores: rates x {share:g}, host times / {share:g}"
    out = profile.with_name(f"{profile.stem}-{nproc}procs.json")
    out.write_text(json.dumps(data, indent=1))
    return out


def bench_command(name: str, data: Path, profile: Path, steps: int) -> list[str]:
    nproc, sets = LAYOUTS[name]
    cmd = torchrun(nproc) + ["-m", "ember", "bench", str(RECIPE), "--data", str(data), "--steps", str(steps),
                             "--warmup", "2", "--profile", str(profile), "--json"]
    for item in MODEL + sets:
        cmd += ["--set", item]
    return cmd


def prepare_data(folder: Path) -> Path:
    corpus, data = folder / "stdlib.jsonl", folder / "data"
    ember = [sys.executable, "-m", "ember"]
    subprocess.run(ember + ["data", "corpus", "--out", str(corpus)], check=True, capture_output=True)
    subprocess.run(ember + ["data", "prepare", str(corpus), "--out", str(data), "--tokenizer", "bpe",
                            "--vocab-size", "2048", "--seq-len", "128"], check=True, capture_output=True)
    return data


def _run(cmd: list[str]) -> str:
    # One thread per process in every run, the calibration's included (torchrun sets this
    # only for several processes): a rank is then one core, as the profile describes it.
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _json(stdout: str) -> dict:
    start = stdout.index("{")
    return json.loads(stdout[start:])


def summarise(rows: list[dict], key: str = "predicted_step_s") -> dict:
    errors = [r[key] / r["measured_step_s"] - 1 for r in rows]
    fastest = min(rows, key=lambda r: r["measured_step_s"])["layout"]
    planner_top = [r["layout"] for r in sorted(rows, key=lambda r: r[key])[:2]]
    out = {"median_abs_error": statistics.median(abs(e) for e in errors), "bias": statistics.median(errors),
           "measured_fastest": fastest, "planner_top2": planner_top, "fastest_in_top2": fastest in planner_top}
    if key == "predicted_step_s":
        out["modelled"] = summarise(rows, "modelled_step_s")
    return out


def report(rows: list[dict], summary: dict, args) -> str:
    lines = [f"ember plan vs measured on this CPU ({os.cpu_count()} cores), {datetime.date.today()}",
             f"command: python benchmarks/planner_vs_measured_cpu.py {' '.join(sys.argv[1:])}",
             f"model: {RECIPE.name} with {' '.join(MODEL)}; {args.steps} measured steps after 2 warm-up; "
             f"meas s = the fastest of {args.rounds} round(s), run round-robin (every round in 'rounds')",
             "pred s: with the matmul and attention shapes the calibration timed; model s: from the planner's "
             "kernel models alone",
             "", f"{'layout':<20}{'procs':>6}{'pred s':>9}{'meas s':>9}{'error':>8}{'model s':>9}{'error':>8}"
                 f"{'pred GiB':>10}{'meas GiB':>10}  rounds"]
    for r in rows:
        lines.append(f"{r['layout']:<20}{r['procs']:>6}{r['predicted_step_s']:>9.3f}{r['measured_step_s']:>9.3f}"
                     f"{100 * (r['predicted_step_s'] / r['measured_step_s'] - 1):>+7.1f}%"
                     f"{r['modelled_step_s']:>9.3f}{100 * (r['modelled_step_s'] / r['measured_step_s'] - 1):>+7.1f}%"
                     f"{r['predicted_gib']:>10.3f}{r['measured_gib']:>10.3f}  "
                     + " ".join(f"{s:.3f}" for s in r["rounds_s"]))
    lines.append("")
    for label, s in (("", summary), ("kernel models alone: ", summary["modelled"])):
        verdict = "in" if s["fastest_in_top2"] else "NOT in"
        lines += [(f"{label}median |step-time error| {100 * s['median_abs_error']:.1f}% "
                   f"(bias {100 * s['bias']:+.1f}%); target <= 20%"),
                  (f"{label}measured fastest {s['measured_fastest']}; planner's top two {s['planner_top2']}: "
                   f"{verdict} the top two")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2,
                        help="measure every layout this many times, round-robin, and keep each one's fastest "
                             "(a shared machine's slow spells then fall on different layouts, not one)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile, data, recipe = folder / "profile.json", folder / "data", folder / "model.toml"
        if args.dry_run:
            print(" ".join(calibrate_command(profile, recipe)))
            for name in names:
                print(" ".join(bench_command(name, data, profile, args.steps)))
            return 0
        data = prepare_data(folder)
        _run(calibrate_command(profile, write_recipe(folder, data)))
        # Kept with the results: run to run, the predictions move with what calibration measured.
        calibration = json.loads(profile.read_text())
        rows: dict[str, dict] = {}
        for round_ in range(max(1, args.rounds)):
            for name in names:
                rank_profile = shared_profile(profile, LAYOUTS[name][0], os.cpu_count() or 1)
                result = _json(_run(bench_command(name, data, rank_profile, args.steps)))
                predicted = result.get("predicted")
                if not predicted:
                    raise SystemExit(f"{name}: ember bench printed no prediction (is the profile readable?)")
                row = rows.setdefault(name, {"layout": name, "procs": LAYOUTS[name][0], "rounds_s": [],
                                             "predicted_step_s": predicted["step_s"],
                                             "modelled_step_s": predicted.get("modelled_kernels_step_s",
                                                                              predicted["step_s"]),
                                             "predicted_gib": predicted["memory_gib"], "measured_gib": 0.0})
                row["rounds_s"].append(result["step_s"])
                row["measured_step_s"] = min(row["rounds_s"])
                row["measured_gib"] = max(row["measured_gib"], max(r["peak_reserved_gib"] for r in result["ranks"]))
                print(f"round {round_ + 1}: {name} {result['step_s']:.3f} s", flush=True)
        rows = list(rows.values())
    summary = summarise(rows)
    text = report(rows, summary, args)
    print(text, end="")
    stamp = f"{datetime.date.today()}-planner-vs-measured-cpu"
    results = REPO / "benchmarks" / "results"
    (results / f"{stamp}.txt").write_text(text)
    (results / f"{stamp}.json").write_text(json.dumps({"rows": rows, "summary": summary, "profile": calibration},
                                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
