"""What tensor parallelism costs the host: one of ember's transformer blocks, forward and
backward, on tensors too small for compute to matter, plain and split over a tensor-parallel
mesh (DTensor, eager), beside the collectives the split block issues.

    python benchmarks/tp_host_overhead.py                 # 2 processes, gloo, on this machine
    python benchmarks/tp_host_overhead.py --nproc 4 --iters 2000

`ember plan` prices a tensor-parallel layer as its compute, its collectives and a host time
per launched call (plan/predict.py). Eager DTensor dispatch (sharding propagation, the
redistribution logic, the wrapper tensors) costs the host more than a plain op; a compiled
block traces it away. This measures that extra, per block pass, as
    split block - plain block - collectives x (time of one small all-reduce),
with the collectives counted as they reach the dispatcher (functional c10d ops); the
measurement is ember.tune.host_cost's, which `ember plan calibrate` also runs. It is a CPU
figure when run here: say so wherever it is quoted.
Writes benchmarks/results/<date>-tp-host-overhead.txt.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(iters: int) -> str | None:
    import torch
    import torch.distributed as dist

    from ember.process import end_process_group
    from ember.tune.host_cost import split_block_host

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    m = split_block_host(torch.device("cpu"), iters)
    rank = dist.get_rank()
    end_process_group()
    if rank != 0:
        return None
    n = m["tp"]
    return (f"one block (hidden {m['hidden']}, 16 tokens), forward + backward, {n} processes, 1 thread each, "
            f"gloo, {iters} passes\n"
            f"  plain block            {1e3 * m['plain_s']:8.3f} ms\n"
            f"  split over tp={n} (eager) {1e3 * m['split_s']:8.3f} ms\n"
            f"  collectives in it      {m['collectives']:8d}   (c10d ops dispatched)\n"
            f"  one small all-reduce   {1e3 * m['all_reduce_s']:8.3f} ms\n"
            f"  host time the split adds beyond its collectives: "
            f"{1e3 * m['tp_host_s_per_layer']:.3f} ms per block pass\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from ember.process import leave

        text = worker(args.iters)
        if text:
            print(text, end="")
        leave(0)
    if args.nproc < 2 or args.iters < 1:
        print("tp_host_overhead: --nproc must be at least 2 and --iters at least 1.", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={args.nproc}", __file__, "--worker", "--iters", str(args.iters)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    text = (f"tensor parallelism's host cost on this machine ({os.cpu_count()} cores), "
            f"{datetime.date.today().isoformat()}\ncommand: python benchmarks/tp_host_overhead.py "
            f"--nproc {args.nproc} --iters {args.iters}\n" + done.stdout)
    print(text, end="")
    if not args.no_write:
        out = REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-tp-host-overhead.txt"
        out.write_text(text)
        print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
