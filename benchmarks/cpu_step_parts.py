"""Where one process's forward and backward pass spends its time on this CPU, part by part,
beside what `ember plan` prices for the same parts: matmuls, attention, and everything else
(elementwise work, copies, the autograd engine and the dispatcher).

    python benchmarks/cpu_step_parts.py                         # calibrates this machine first (~30 s)
    python benchmarks/cpu_step_parts.py --profile PROFILE.json  # or prices with a calibrated CPU profile

`benchmarks/planner_vs_measured_cpu.py` compares whole steps; this splits one. The model is
that benchmark's (configs/tiny-gpt.toml at 4 x 256, sequence 128, vocabulary 2,048), one
process with one thread (as a rank of that benchmark runs), fp32, eager. The measured parts
are the PyTorch profiler's self CPU time by operator over three passes (one thread: the
parts add up to the pass): `aten::mm`/`addmm`/`bmm` are matmuls, the scaled-dot-product
operators attention, the rest the rest. The predicted parts are the planner's `matmul_s`,
`attention_s` and `elementwise_s + launch_s` of the same layout, priced with PROFILE (with the
matmul and attention times it measured, and again with its kernel models alone); without
--profile, one process with one thread calibrates first with `ember plan calibrate --model`
(the benchmark's recipe, one GPU, global batch 16), so the shapes it times are this run's.
Writes benchmarks/results/<date>-cpu-step-parts.txt.
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
MODEL = ["model.hidden=256", "model.layers=4", "model.heads=4", "model.mlp_hidden=768", "model.max_seq_len=128",
         "model.vocab_size=2048", "train.compile=false"]
SEQUENCES = 16  # the step's global batch
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def measured_parts(micro_batch: int) -> dict:
    """Seconds per step of each part: SEQUENCES // micro_batch forward and backward passes."""
    import torch
    from torch.profiler import profile

    from ember.config import load_config
    from ember.model.transformer import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(load_config(REPO / "configs" / "tiny-gpt.toml", MODEL).model)
    ids = torch.randint(2048, (micro_batch, 128))
    steps, passes = 3, SEQUENCES // micro_batch

    def step():
        for _ in range(passes):
            model(ids, ids).backward()

    for _ in range(2):
        step()
    with profile() as prof:
        for _ in range(steps):
            step()
    parts = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    for event in prof.key_averages():
        kind = ("matmul" if event.key in MATMULS else "attention" if "scaled_dot_product" in event.key else "rest")
        parts[kind] += event.self_cpu_time_total / 1e6 / steps
    return parts


def predicted_parts(profile: Path, micro_batch: int, kernels: bool) -> dict:
    """The planner's parts for one process at `micro_batch`, priced with `profile` (its
    measured kernel times left out unless `kernels`)."""
    data = json.loads(profile.read_text())
    if not kernels:
        data.pop("matmuls", None)
        data.pop("attention", None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(data))
        cmd = [sys.executable, "-m", "ember", "plan", "--model", str(REPO / "configs" / "tiny-gpt.toml"),
               "--precision", "fp32", "--global-batch", str(SEQUENCES), "--profile", str(path), "--gpus", "1",
               "--layout", f"tp=1,mbs={micro_batch}", "--json"]
        for item in MODEL:
            cmd += ["--set", item]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    detail = json.loads(done.stdout)["detail"]
    return {"matmul": detail["matmul_s"], "attention": detail["attention_s"],
            "rest": detail["elementwise_s"] + detail["launch_s"]}


def calibrate(folder: Path) -> Path:
    """A one-thread profile of this machine with the model's kernel shapes timed."""
    from ember.config import load_config, to_toml

    recipe, profile = folder / "recipe.toml", folder / "cpu1.json"
    recipe.write_text(to_toml(load_config(REPO / "configs" / "tiny-gpt.toml", MODEL)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "ember", "plan", "calibrate", "--out", str(profile), "--dtype", "fp32",
                    "--model", str(recipe), "--gpus", "1", "--global-batch", str(SEQUENCES)],
                   capture_output=True, text=True, env=env, check=True)
    return profile


def report(profile: Path, label: str) -> str:
    lines = [f"one process's forward and backward on this CPU ({os.cpu_count()} cores), part by part, "
             f"{datetime.date.today().isoformat()}",
             f"command: python benchmarks/cpu_step_parts.py {label}".rstrip(),
             f"model: tiny-gpt.toml with {' '.join(MODEL)}; {SEQUENCES} sequences a step, 1 thread, fp32, eager",
             "seconds per step; measured: profiler self CPU time; predicted: ember plan with the profile's "
             "measured kernel times (pred) and with its kernel models alone (model)", "",
             f"{'micro-batch':>11}  {'part':<10}{'measured':>10}{'pred':>9}{'ratio':>7}{'model':>9}{'ratio':>7}"]
    for micro_batch in (16, 4):
        meas = measured_parts(micro_batch)
        pred, model = predicted_parts(profile, micro_batch, True), predicted_parts(profile, micro_batch, False)
        for part in ("matmul", "attention", "rest"):
            lines.append(f"{micro_batch:>11}  {part:<10}{meas[part]:>10.3f}{pred[part]:>9.3f}"
                         f"{pred[part] / meas[part]:>7.2f}{model[part]:>9.3f}{model[part] / meas[part]:>7.2f}")
        total = [sum(d.values()) for d in (meas, pred, model)]
        lines.append(f"{micro_batch:>11}  {'total':<10}{total[0]:>10.3f}{total[1]:>9.3f}{total[1] / total[0]:>7.2f}"
                     f"{total[2]:>9.3f}{total[2] / total[0]:>7.2f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="a calibrated CPU profile (default: calibrate this machine first)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.profile is not None and not Path(args.profile).is_file():
        print(f"cpu_step_parts: --profile {args.profile} is not a file.", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO / "src"))
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(args.profile) if args.profile else calibrate(Path(tmp))
        text = report(profile, f"--profile {profile.name}" if args.profile else "")
    print(text, end="")
    if not args.no_write:
        out = REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-cpu-step-parts.txt"
        out.write_text(text)
        print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
