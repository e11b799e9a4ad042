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
with the collectives counted as they reach the dispatcher (functional c10d ops). It is a
CPU figure when run here: say so wherever it is quoted.
Writes benchmarks/results/<date>-tp-host-overhead.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(iters: int) -> str | None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from ember.config import ModelConfig
    from ember.model.layers import Block
    from ember.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    shape = dict(objective="causal", vocab_size=128, hidden=64 * n, layers=1, heads=2 * n, mlp_hidden=256 * n,
                 max_seq_len=16)
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k in names})

    class OneBlock(nn.Module):  # the layout apply_tensor_parallel expects: blocks by name
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"0": Block(cfg)})

        def forward(self, x):
            return self.blocks["0"](x)

    def seconds(module) -> float:
        x = torch.randn(1, 16, cfg.hidden, requires_grad=True)
        for _ in range(10):
            module(x).sum().backward()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            module(x).sum().backward()
        dist.barrier()
        return (time.perf_counter() - start) / iters

    torch.manual_seed(0)
    plain, split = OneBlock(), OneBlock()
    plain_s = seconds(plain)
    apply_tensor_parallel(split, init_device_mesh("cpu", (n,)), sequence_parallel=False)
    split_s = seconds(split)
    class CountCollectives(TorchDispatchMode):
        # DTensor's collectives reach dispatch as functional c10d ops on plain tensors.
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("_c10d_functional", "c10d") and any(
                    kind in func.__name__ for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")):
                CountCollectives.count += 1
            return func(*args, **(kwargs or {}))

    with CountCollectives():
        split(torch.randn(1, 16, cfg.hidden, requires_grad=True)).sum().backward()
    collectives = CountCollectives.count
    small = torch.zeros(16)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(small)
    all_reduce_s = (time.perf_counter() - start) / iters
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    extra = split_s - plain_s - collectives * all_reduce_s
    return (f"one block (hidden {cfg.hidden}, {cfg.heads} heads, MLP {cfg.mlp_hidden}, 16 tokens), forward + backward, "
            f"{n} processes, 1 thread each, gloo, {iters} passes\n"
            f"  plain block            {1e3 * plain_s:8.3f} ms\n"
            f"  split over tp={n} (eager) {1e3 * split_s:8.3f} ms\n"
            f"  collectives in it      {collectives:8d}   (c10d ops dispatched)\n"
            f"  one small all-reduce   {1e3 * all_reduce_s:8.3f} ms\n"
            f"  host time the split adds beyond its collectives: {1e3 * extra:.3f} ms per block pass\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        text = worker(args.iters)
        if text:
            print(text, end="")
        return 0
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
