"""How much `ember plan calibrate` moves between runs on this machine, timing each measurement
once (one burst) against keeping the fastest of three (`REPEATS` in plan/calibrate.py).

Runs the calibration `--runs` times for each setting, alternating, under torchrun with two
gloo processes of one thread each (as planner_vs_measured_cpu.py calibrates), and prints
every run's matmul peak, copy bandwidth, attention efficiency and eager tensor parallelism's
host cost per block, the spread of each (largest / smallest - 1) and the wall time.

    python benchmarks/calibration_spread.py            # ~7 minutes on 2 cores
    python benchmarks/calibration_spread.py --runs 2

Run it on a quiet machine. Writes benchmarks/results/<date>-calibration-spread.txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# torchrun runs a script; this one sets the number of bursts before the calibration starts.
WRAPPER = """import sys
import ember.plan.calibrate as calibrate
calibrate.REPEATS = int(sys.argv[1])
from ember.cli import main
sys.exit(main(["plan", "calibrate", "--out", sys.argv[2], "--dtype", "fp32"]))
"""
FIELDS = (("matmul GFLOP/s", lambda p: p["gpu"]["peak_bf16_flops"] / 1e9),
          ("copy GB/s", lambda p: p["gpu"]["hbm_gbps"]),
          ("attn_eff", lambda p: p["gpu"]["attn_eff"]),
          ("tp host ms/block", lambda p: p["stack"]["tp_host_s_per_layer"] * 1e3))


def calibrate(repeats: int, folder: Path) -> tuple[dict, float]:
    wrapper, out = folder / "wrapper.py", folder / f"profile-{repeats}.json"
    wrapper.write_text(WRAPPER)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(wrapper), str(repeats), str(out)], check=True, capture_output=True, env=env)
    return json.loads(out.read_text()), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="calibrations per setting")
    args = parser.parse_args(argv)
    rows: dict[int, list[tuple[dict, float]]] = {1: [], 3: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for repeats in rows:
                rows[repeats].append(calibrate(repeats, Path(tmp)))
                print(f"bursts {repeats}: run {len(rows[repeats])} done", flush=True)
    lines = [f"ember plan calibrate, run after run, on this CPU ({os.cpu_count()} cores), {datetime.date.today()}",
             f"command: python benchmarks/calibration_spread.py --runs {args.runs}",
             "torchrun, 2 gloo processes of one thread, fp32; spread = largest / smallest - 1", ""]
    for repeats, runs in rows.items():
        lines.append(f"bursts per measurement: {repeats}")
        for name, get in FIELDS:
            values = [get(profile) for profile, _ in runs]
            lines.append(f"  {name:<18}" + "".join(f"{v:>9.3g}" for v in values)
                         + f"   spread {max(values) / min(values) - 1:6.1%}")
        lines.append(f"  {'seconds':<18}" + "".join(f"{s:>9.0f}" for _, s in runs))
        lines.append("")
    text = "\n".join(lines)
    print(text)
    out = REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-calibration-spread.txt"
    out.write_text(text)
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
