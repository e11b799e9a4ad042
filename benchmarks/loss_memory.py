"""Peak memory and time of the output layer + cross-entropy: ember's chunked loss
(`ember.model.loss.linear_cross_entropy`) against the unfused reference
(`F.cross_entropy(F.linear(x, w).float(), y)`) that most training loops run, forward and
backward, on the same inputs.

Each variant runs in a fresh process, so the peak resident memory the kernel reports
(VmHWM) is that variant's alone. On a GPU the same script reads CUDA's allocator peak.

    python benchmarks/loss_memory.py --tokens 4096 --vocab 50304 --hidden 768
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ember.device import peak_memory_bytes, pick_device, reset_peak_memory, resident_bytes, synchronize
from ember.model.loss import linear_cross_entropy


def run_one(variant: str, tokens: int, vocab: int, hidden: int, device_name: str, repeats: int) -> dict:
    device = pick_device(device_name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).div_(hidden ** 0.5).to(device).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02).to(device).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen).to(device)

    def step() -> torch.Tensor:
        if variant == "fused":
            loss = linear_cross_entropy(x, w, y, "sum")
        else:
            loss = F.cross_entropy(F.linear(x, w).float(), y, reduction="sum")
        loss.backward()
        return loss

    step()  # warm-up: allocator and kernels
    x.grad = w.grad = None
    synchronize(device)
    base = resident_bytes() if device.type == "cpu" else torch.cuda.memory_allocated(device)
    reset_peak_memory(device)
    start = time.perf_counter()
    for _ in range(repeats):
        loss = step()
        x.grad = w.grad = None
    synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    peak = peak_memory_bytes(device)
    return {"variant": variant, "loss": float(loss), "seconds": seconds,
            "peak_above_inputs_mib": (peak - (base or 0)) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=["fused", "reference"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.tokens, args.vocab, args.hidden, args.device, args.repeats)))
        return
    results = {}
    for variant in ("reference", "fused"):
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--tokens", str(args.tokens),
                              "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--device", args.device,
                              "--repeats", str(args.repeats)], check=True, capture_output=True, text=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    ref, fused = results["reference"], results["fused"]
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"output layer + cross-entropy, forward and backward: {args.tokens} tokens x {args.vocab} vocabulary x "
          f"{args.hidden} hidden, fp32, {args.device} (fp32 logits alone: {logits_mib:.0f} MiB)")
    print(f"{'':12}{'peak MiB':>10}{'seconds':>10}{'loss':>14}")
    for name, r in (("reference", ref), ("ember", fused)):
        print(f"{name:12}{r['peak_above_inputs_mib']:>10.0f}{r['seconds']:>10.3f}{r['loss']:>14.4f}")
    print(f"memory: reference / ember = {ref['peak_above_inputs_mib'] / max(fused['peak_above_inputs_mib'], 1e-9):.1f}x;"
          f" time: ember / reference = {fused['seconds'] / ref['seconds']:.2f}x;"
          f" loss difference {abs(fused['loss'] - ref['loss']) / abs(ref['loss']):.1e} (relative)")


if __name__ == "__main__":
    main()
