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
figure when run here: say so wherever it is quoted. It also measures the parts around the
blocks (embedding, output layer, loss over sharded logits) the same way.
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


def edges_host(iters: int, block_host_s: float) -> dict:
    """The parts around the blocks, measured the same way: a one-block model (vocabulary-
    parallel embedding, final norm, vocabulary-parallel output layer and the cross-entropy
    over its sharded logits under loss_parallel), plain and split, less its collectives and
    its block's own extra. These stay eager in a compiled run; the planner does not price
    them (docs/planner.md says why)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ember.model.transformer import Transformer
    from ember.parallel.tensor import apply_tensor_parallel, loss_parallel_context
    from ember.tune.host_cost import CountCollectives, block_config, seconds_per_call

    cpu, n = torch.device("cpu"), dist.get_world_size()
    cfg = block_config(n)
    torch.manual_seed(0)  # the same model and batch on every rank
    ids = torch.randint(cfg.vocab_size, (1, 16))
    plain, split = Transformer(cfg), Transformer(cfg)
    plain_s = seconds_per_call(lambda: plain(ids, ids).backward(), cpu, iters)
    apply_tensor_parallel(split, init_device_mesh("cpu", (n,)), sequence_parallel=False)

    def step():
        with loss_parallel_context(split):
            split(ids, ids).backward()

    split_s = seconds_per_call(step, cpu, iters)
    with CountCollectives() as counter:
        step()
    small = torch.zeros(16)
    all_reduce_s = seconds_per_call(lambda: dist.all_reduce(small), cpu, iters)
    extra = split_s - plain_s - counter.count * all_reduce_s - cfg.layers * block_host_s
    return {"vocab": cfg.vocab_size, "plain_s": plain_s, "split_s": split_s, "collectives": counter.count,
            "extra_s": extra}


def worker(iters: int) -> str | None:
    import torch
    import torch.distributed as dist

    from ember.process import end_process_group
    from ember.tune.host_cost import split_block_host

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    m = split_block_host(torch.device("cpu"), iters)
    e = edges_host(iters, m["tp_host_s_per_layer"])
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
            f"{1e3 * m['tp_host_s_per_layer']:.3f} ms per block pass\n"
            f"a one-block model (vocabulary {e['vocab']}), forward + backward with its loss\n"
            f"  plain model            {1e3 * e['plain_s']:8.3f} ms\n"
            f"  split over tp={n} (eager, loss_parallel) {1e3 * e['split_s']:8.3f} ms, "
            f"{e['collectives']} collectives\n"
            f"  host time the embedding, output layer and loss add beyond their collectives "
            f"(the block's extra taken off): {1e3 * e['extra_s']:.3f} ms per micro-batch\n")


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
