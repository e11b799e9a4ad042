"""One command for a user with one GPU: ember's training step against Hugging Face
`transformers` on the same model shape, batch and GPU, both compiled the same way (each
transformer layer with torch.compile), bf16 autocast, fused AdamW. Prints tokens/s, MFU
(model FLOPs from `ember.cost`, the same count for both, over the GPU's dense bf16 peak)
and peak memory for GPT-2 124M, Cramming's BERT and Llama 1B.

    python benchmarks/gpu_step.py                       # on CUDA: the three models
    python benchmarks/gpu_step.py --models gpt2 --steps 50 --no-compile
    python benchmarks/gpu_step.py --dry-run             # tiny shapes on the CPU (the tests run this)

Tokens are random ids: the step's speed does not depend on what they say. A masked LM
masks 25% of the positions (Cramming's rate): ember predicts only those, BERT every
position, as each does in training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from vs_transformers import HFLossAdapter, compile_layers, hf_model  # noqa: E402

from ember.config import load_config  # noqa: E402
from ember.cost import model_flops_per_token  # noqa: E402
from ember.device import device_name, device_peak_flops  # noqa: E402
from ember.model import Transformer  # noqa: E402

# family -> (recipe, transformers family, shape at full size, shape for --dry-run)
MODELS = {
    "gpt2": ("gpt2-small.toml", "gpt2", dict(hidden=768, layers=12, heads=12, mlp=3072, seq=1024, mb=16, vocab=50257)),
    "bert": ("cram-bert.toml", "bert", dict(hidden=768, layers=16, heads=12, mlp=3072, seq=128, mb=128, vocab=32768)),
    "llama": ("llama-1b.toml", "llama", dict(hidden=2048, layers=22, heads=16, mlp=5632, seq=2048, mb=4, vocab=32000)),
}
TINY = dict(hidden=64, layers=2, heads=4, mlp=128, seq=32, mb=4, vocab=512)


def build(name: str, shape: dict, device: torch.device):
    recipe, family, _ = MODELS[name]
    # Cramming's GeGLU splits its 4h projection into gate and value: BERT's parameter count.
    mlp = shape["mlp"] // 2 if family == "bert" else shape["mlp"]
    cfg = load_config(REPO / "configs" / recipe, [
        f"model.hidden={shape['hidden']}", f"model.layers={shape['layers']}", f"model.heads={shape['heads']}",
        f"model.mlp_hidden={mlp}", f"model.max_seq_len={shape['seq']}", f"model.vocab_size={shape['vocab']}",
        "model.dropout=0"])
    torch.manual_seed(0)
    ours = Transformer(cfg.model).to(device)
    theirs = HFLossAdapter(hf_model(family, shape, cfg.model.padded_vocab)).to(device)
    return cfg, ours, theirs


def batch(cfg, shape: dict, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape["vocab"], (shape["mb"], shape["seq"]), generator=gen)
    if cfg.model.objective == "mlm":
        labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.25, ids, torch.full_like(ids, -100))
    else:
        labels = torch.roll(ids, -1, dims=1)
    return ids.to(device), labels.to(device)


def time_steps(model, cfg, shape, device, steps: int, warmup: int, amp: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(warmup + steps):
        ids, labels = batch(cfg, shape, device, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(ids, labels, reduction="mean")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": statistics.median(times), "peak_gib": peak, "loss": float(loss.detach())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert,llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, 2 steps, on the CPU, fp32, eager")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not args.dry_run:
        raise SystemExit("no CUDA GPU here: this benchmark measures a GPU (use --dry-run to check it runs).")
    steps, warmup = (2, 1) if args.dry_run else (args.steps, args.warmup)
    compiled, amp = not (args.no_compile or args.dry_run), device.type == "cuda"
    peak = device_peak_flops(device)
    rows = []
    print(f"{device_name(device)}; {'compiled layers' if compiled else 'eager'}; "
          f"{'bf16 autocast' if amp else 'fp32'}; median of {steps} steps after {warmup}")
    for name in args.models.split(","):
        shape = TINY if args.dry_run else MODELS[name][2]
        cfg, ours, theirs = build(name, shape, device)
        tokens = shape["mb"] * shape["seq"]
        fraction = 0.25 if cfg.model.objective == "mlm" else 1.0
        flops = model_flops_per_token(cfg.model, shape["seq"], fraction) * tokens
        for who, model in (("ember", ours), ("transformers", theirs)):
            if compiled:
                compile_layers(model)
            r = time_steps(model, cfg, shape, device, steps, warmup, amp)
            r.update(model=name, impl=who, tokens_per_s=tokens / r["step_s"],
                     mfu=flops / r["step_s"] / peak if peak else None)
            rows.append(r)
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            memory = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "n/a"
            print(f"{name:6} {who:13} {r['tokens_per_s']:>12,.0f} tok/s  MFU {mfu:>6}  peak {memory}", flush=True)
        del ours, theirs
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
