"""One transformer block's forward and backward with q/k/v and gate/up fused into one matmul
each (ember's default) against one nn.Linear per projection (`fused = False`, what a
tensor-parallel block runs), same weights and inputs, alternating rounds in one process.

Reported: the median seconds of a forward + backward in each, and their ratio. On a CPU the
numbers are this CPU's only; they say nothing about a GPU.

    python benchmarks/fused_projections.py                          # 512 hidden, 4 x 256 tokens, fp32
    python benchmarks/fused_projections.py --bf16 --out benchmarks/results/DATE-fused-projections-cpu.txt
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import time

import torch

from ember.config import ModelConfig
from ember.model.layers import Block


def step_seconds(block: Block, x: torch.Tensor, amp: bool) -> float:
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        out = block(x)
    out.float().sum().backward()
    block.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--mlp-hidden", type=int, default=1408)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4, help="steps of each variant per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="also measure under bf16 autocast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig(vocab_size=128, hidden=args.hidden, heads=args.heads, mlp_hidden=args.mlp_hidden,
                      layers=1, max_seq_len=args.seq, activation="swiglu", norm="rmsnorm", positions="rotary")
    torch.manual_seed(0)
    fused = Block(cfg)
    plain = copy.deepcopy(fused)
    plain.attn.fused = plain.mlp.fused = False
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)

    load = os.getloadavg()[0]
    lines = [f"fused projections, {datetime.date.today()}: one block (swiglu, rmsnorm, rotary) {args.hidden} hidden, "
             f"{args.heads} heads, {args.mlp_hidden} mlp, batch {args.batch} x {args.seq}, CPU "
             f"({torch.get_num_threads()} threads), median of {args.rounds} rounds x {args.steps} steps, "
             f"forward + backward; load average {load:.1f} at start",
             "precision  fused s  unfused s  fused / unfused"]
    for amp in ([False, True] if args.bf16 else [False]):
        times = {"fused": [], "plain": []}
        for block in (fused, plain):  # warm-up
            step_seconds(block, x, amp)
        for _ in range(args.rounds):
            for name, block in (("fused", fused), ("plain", plain)):
                times[name] += [step_seconds(block, x, amp) for _ in range(args.steps)]
        f, p = statistics.median(times["fused"]), statistics.median(times["plain"])
        lines.append(f"{'bf16' if amp else 'fp32':9}  {f:7.4f}  {p:9.4f}  {f / p:15.3f}")
    lines.append(f"load average {os.getloadavg()[0]:.1f} at end; a CPU measurement, no GPU claim")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
