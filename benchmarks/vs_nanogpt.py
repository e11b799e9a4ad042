"""ember end to end against what a user would train instead, on this machine, same tokens.

1. GPT: ember's Trainer (configs/gpt2-small.toml's recipe at a CPU shape) against a
   nanoGPT-style loop (`vs_nanogpt_baselines.py`: nanoGPT's GPT class and train.py's
   optimizer, schedule and clipping), same shape, same lr, betas, weight decay, warmup and
   cosine, for the same steps on the same rows in the same order; for --seeds seeds (seed s
   sets both the initial weights and the data order, for both sides).
2. BERT: ember's masked LM (configs/tiny-bert.toml) against transformers' Trainer on
   BertForMaskedLM with DataCollatorForLanguageModeling at ember's masking rate, same shape,
   rows, order, optimizer settings and lr schedule.

Both sides of a pair step in alternation (one step each, in turn), so the two share the
machine's conditions: this CPU is shared, and a neighbour's load slows both instead of
biasing the ratio. tokens/s counts the steps after the first two. One evaluator scores
every model: the mean cross-entropy per predicted token over the same held-out rows (the
first rows of the val split; for MLM with ember's fixed held-out masks), from each
model's full logits.

    python benchmarks/vs_nanogpt.py --out benchmarks/results/DATE-vs-nanogpt-cpu.txt --json FILE
    python benchmarks/vs_nanogpt.py --dry-run          # toy shapes, seconds (the test runs it)

Data: the built-in corpus (`ember data corpus`), prepared into --work (default: a temp dir).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.budget import Budget
from ember.config import load_config
from ember.data import Batches, held_out_seed, make_targets
from ember.data.corpus import write_stdlib_corpus
from ember.data.prepare import prepare
from ember.train.schedule import Progress, lr_factor
from ember.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_nanogpt_baselines import GPT, GPTConfig, get_lr, hf_bert_trainer, hf_tokenizer, nanogpt_step  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SKIP = 2  # steps left out of tokens/s: first allocations
TARGETS = {"gpt": 1.1, "bert": 1.3}  # ember's tokens/s over the baseline's that the issue asks for
GPT_SHAPES = {
    "default": dict(layers=6, hidden=384, heads=6, seq=256, batch=16, vocab=8192),
    "small": dict(layers=4, hidden=256, heads=4, seq=128, batch=16, vocab=8192),
    "dry": dict(layers=2, hidden=64, heads=2, seq=64, batch=4, vocab=512),
}
# gpt2-small.toml's recipe is for 124M parameters and 5e9 tokens; a run of a few dozen
# steps of this 6 x 384 shape takes nanoGPT's own lr for it (config/train_shakespeare_char.py:
# 1e-3, floor 1e-4 = gpt2-small's min_lr_ratio) and a warmup of a tenth of the run (gpt2-small's
# 1% would be under one step). Both sides get the same values.
SHORT_RUN = ["optim.lr=1e-3", "schedule.warmup=0.1"]
# BERT's GELU MLP of width `mlp` against ember's GeGLU of mlp/2 (Cramming splits one 4h
# projection into gate and value halves), as benchmarks/vs_transformers.py does.
BERT_SHAPES = {
    "default": dict(layers=4, hidden=256, heads=4, mlp=1024, seq=128, micro=32, batch=64, vocab=8192),
    "dry": dict(layers=2, hidden=64, heads=2, mlp=256, seq=64, micro=4, batch=8, vocab=512),
}


def prepared(work: Path, tokenizer: str, vocab: int, seq: int, dry: bool) -> tuple[Path, dict]:
    out = work / f"data-{tokenizer}-{vocab}-{seq}"
    if not (out / "manifest.json").exists():
        corpus = work / "stdlib.jsonl"
        if not corpus.exists():
            write_stdlib_corpus(corpus)
            if dry:
                corpus.write_text("".join(corpus.read_text().splitlines(keepends=True)[:800]))
        prepare([corpus], out, tokenizer=tokenizer, vocab_size=vocab, seq_len=seq, val_fraction=0.03,
                progress=False)
    return out, json.loads((out / "manifest.json").read_text())


@torch.no_grad()
def held_out_loss(logits_of, rows: torch.Tensor, cfg, manifest: dict, micro: int) -> float:
    """The one evaluator: mean cross-entropy per predicted token of `logits_of(inputs,
    labels)` (full logits [B, T, V]) over `rows`, with ember's targets (next token, or
    ember's held-out masks)."""
    inputs, labels = make_targets(rows, cfg.model.objective, cfg.data, manifest["special_tokens"],
                                  manifest["vocab_size"], held_out_seed(cfg.data.seed))
    total, count = 0.0, 0
    for start in range(0, len(rows), micro):
        x, y = inputs[start:start + micro], labels[start:start + micro]
        logits = logits_of(x, y).float()
        total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))
        count += int((y != -100).sum())
    return total / max(count, 1)


def eval_rows(data: Path, manifest: dict, n: int) -> torch.Tensor:
    return Batches(data, manifest, "val").fixed(n).ids


def ember_trainer(recipe: str, data: Path, run_dir: Path, sets: list[str]) -> Trainer:
    cfg = load_config(REPO / "configs" / recipe, sets + [
        "train.device=cpu", "train.compile=false", "train.eval_every=1000000steps",
        "train.checkpoint_every=1000000steps", "train.on_spike=off"])
    trainer = Trainer(cfg, data, run_dir, progress=False)
    trainer.build()
    return trainer


def lr_multiplier(step: int, steps: int, schedule) -> float:
    """The lr multiplier `Trainer.run` gives step `step` (0-based) of a run of `steps` steps."""
    return lr_factor(Progress(step=step).step_fraction(Budget("steps", steps), 0, 0.0), schedule)


def ember_lr(trainer: Trainer, step: int, steps: int) -> float:
    return trainer.cfg.optim.lr * lr_multiplier(step, steps, trainer.cfg.schedule)


def steady(seconds: list[float]) -> list[float]:
    return seconds[SKIP:] if len(seconds) > SKIP else seconds


def rate(seconds: list[float], tokens_per_step: int) -> float:
    return tokens_per_step * len(steady(seconds)) / sum(steady(seconds))


def adamw(optimizer) -> str:
    """Which AdamW kernel: where a CPU step spends much of its time."""
    d = optimizer.defaults
    return "fused AdamW" if d.get("fused") else ("foreach AdamW" if d.get("foreach") else "for-loop AdamW")


def timed(fn) -> float:
    start = time.perf_counter()
    float(fn().detach())  # reads the loss: the step is done
    return time.perf_counter() - start


def gpt_seed(data: Path, manifest: dict, s: dict, steps: int, seed: int, runs: Path, val: torch.Tensor,
             sets: list[str]) -> dict:
    trainer = ember_trainer("gpt2-small.toml", data, runs / f"gpt-{seed}", [
        f"model.layers={s['layers']}", f"model.hidden={s['hidden']}", f"model.heads={s['heads']}",
        f"model.mlp_hidden={4 * s['hidden']}", f"model.max_seq_len={s['seq']}", "model.vocab_size=0",
        f"train.micro_batch={s['batch']}", f"train.global_batch={s['batch']}", f"train.seed={seed}",
        f"data.seed={seed}", *SHORT_RUN, *sets])
    cfg, o = trainer.cfg, trainer.cfg.optim
    torch.manual_seed(seed)
    gpt = GPT(GPTConfig(block_size=s["seq"], vocab_size=cfg.model.padded_vocab, n_layer=s["layers"],
                        n_head=s["heads"], n_embd=s["hidden"], dropout=0.0, bias=cfg.model.bias))
    optimizer = gpt.configure_optimizers(o.weight_decay, o.lr, tuple(o.betas), "cpu")
    rows = Batches(data, manifest, "train", seed=cfg.data.seed)  # the loader ember's Trainer reads
    warmup_iters = round(cfg.schedule.warmup * steps)
    seconds = {"ember": [], "nanogpt": []}

    def nano(it: int):
        x, y = make_targets(rows.next(s["batch"]).ids, "causal", cfg.data, {}, 0, 0)
        lr = get_lr(it, warmup_iters, steps, o.lr, o.lr * cfg.schedule.min_lr_ratio)
        return nanogpt_step(gpt, optimizer, x, y, lr, o.clip)

    for it in range(steps):
        sides = ("ember", "nanogpt") if it % 2 == 0 else ("nanogpt", "ember")
        for side in sides:
            if side == "ember":
                seconds[side].append(timed(lambda: trainer.train_step(s["batch"], ember_lr(trainer, it, steps))[0]))
            else:
                seconds[side].append(timed(lambda: nano(it)))
    tokens = s["batch"] * s["seq"]
    trainer.model.eval()
    gpt.eval()
    out = {"ember": {"tokens_per_s": rate(seconds["ember"], tokens),
                     "val_loss": held_out_loss(lambda x, y: trainer.model(x), val, cfg, manifest, s["batch"]),
                     "seconds": sum(seconds["ember"]), "steady": steady(seconds["ember"])},
           "nanogpt": {"tokens_per_s": rate(seconds["nanogpt"], tokens),
                       "val_loss": held_out_loss(lambda x, y: gpt(x, y)[0], val, cfg, manifest, s["batch"]),
                       "seconds": sum(seconds["nanogpt"]), "steady": steady(seconds["nanogpt"])},
           "seed": seed}
    out["optimizer"] = {"ember": adamw(trainer.optimizer), "nanogpt": adamw(optimizer)}
    out["precision"] = {"ember": "fp32" if trainer.amp_dtype is None else f"{str(trainer.amp_dtype)[6:]} autocast",
                        "nanogpt": "fp32"}  # nanoGPT's train.py uses no autocast on a CPU
    out["params"] = {"ember": sum(p.numel() for p in trainer.model.parameters()),
                     "nanogpt": sum(p.numel() for p in gpt.parameters())}
    trainer.release()
    return out


def bert_pair(data: Path, manifest: dict, s: dict, steps: int, seed: int, runs: Path, val: torch.Tensor) -> dict:
    import transformers as tf

    trainer = ember_trainer("tiny-bert.toml", data, runs / f"bert-{seed}", [
        f"model.layers={s['layers']}", f"model.hidden={s['hidden']}", f"model.heads={s['heads']}",
        f"model.mlp_hidden={s['mlp'] // 2}", f"model.max_seq_len={s['seq']}", "model.vocab_size=0",
        f"train.micro_batch={s['micro']}", f"train.global_batch={s['batch']}", f"train.seed={seed}",
        f"data.seed={seed}"])
    cfg, o = trainer.cfg, trainer.cfg.optim
    rows = Batches(data, manifest, "train", seed=cfg.data.seed).next(steps * s["batch"]).ids
    torch.manual_seed(seed)
    bert = tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=cfg.model.padded_vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], intermediate_size=s["mlp"], max_position_embeddings=s["seq"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
    ember_seconds: list[float] = []

    def ember_step(done: int) -> None:  # after the Trainer's step `done` (1-based): ember's same step
        ember_seconds.append(timed(lambda: trainer.train_step(s["batch"], ember_lr(trainer, done - 1, steps))[0]))

    hf_seconds, hf_optimizer = hf_bert_trainer(
        bert, rows, hf_tokenizer(data, manifest), runs / f"hf-{seed}", micro_batch=s["micro"],
        global_batch=s["batch"], steps=steps, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
        clip=o.clip, mlm_rate=cfg.data.mlm_rate, seed=seed, between_steps=ember_step,
        lr_at=lambda k, n: lr_multiplier(k, n, cfg.schedule))
    tokens = s["batch"] * s["seq"]
    trainer.model.eval()
    bert.eval()
    out = {"ember": {"tokens_per_s": rate(ember_seconds, tokens), "seconds": sum(ember_seconds),
                     "val_loss": held_out_loss(lambda x, y: trainer.model(x), val, cfg, manifest, s["micro"])},
           "transformers": {"tokens_per_s": rate(hf_seconds, tokens), "seconds": sum(hf_seconds),
                            "val_loss": held_out_loss(lambda x, y: bert(input_ids=x).logits, val, cfg, manifest,
                                                      s["micro"])},
           "params": {"ember": sum(p.numel() for p in trainer.model.parameters()),
                      "transformers": sum(p.numel() for p in bert.parameters())},
           "optimizer": {"ember": adamw(trainer.optimizer), "transformers": hf_optimizer},
           "seed": seed, "mlm_rate": cfg.data.mlm_rate,
           "steps": {"ember": len(ember_seconds), "transformers": len(hf_seconds)}}
    trainer.release()
    return out


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def summary(result: dict) -> list[str]:
    g, b = result["gpt"], result["bert"]
    gs = g["shape"]
    precision = g["runs"][0]["precision"]
    lines = [f"ember vs nanoGPT-style loop and transformers Trainer on a CPU, {result['date']}: {result['cpu']}, "
             f"{result['threads']} torch threads, eager (CPU numbers, not GPU numbers); GPT precision: ember "
             f"{precision['ember']}, nanoGPT {precision['nanogpt']} (its train.py uses no autocast on a CPU)",
             f"command: {result['command']}",
             f"load average (1/5/15 min) at start {result['load_start']}, at end {result['load_end']}: a shared "
             "machine; each pair stepped in alternation so both sides saw the same load"]
    if result["dry_run"]:
        lines.append("DRY RUN: toy shapes and a few steps; the numbers mean nothing")
    lines += ["", f"GPT {gs['layers']} x {gs['hidden']}, seq {gs['seq']}, batch {gs['batch']}, vocab {g['vocab']}, "
              f"{g['steps']} steps ({g['steps'] * gs['batch'] * gs['seq']:,} tokens) per run, seeds "
              f"{', '.join(str(r['seed']) for r in g['runs'])}; held-out loss over {g['eval_tokens']:,} tokens",
              f"{'seed':>6}{'ember tok/s':>13}{'nanoGPT tok/s':>15}{'ratio':>8}{'ember val':>11}{'nanoGPT val':>13}"]
    for r in g["runs"]:
        e, n = r["ember"], r["nanogpt"]
        lines.append(f"{r['seed']:>6}{e['tokens_per_s']:>13,.0f}{n['tokens_per_s']:>15,.0f}"
                     f"{e['tokens_per_s'] / n['tokens_per_s']:>7.2f}x{e['val_loss']:>11.3f}{n['val_loss']:>13.3f}")
    for side in ("ember", "nanogpt"):
        v = g[side]["val_loss"]
        lines.append(f"{side:>8}: held-out loss {v['mean']:.3f} +- {v['std']:.3f} (min {v['min']:.3f}, max "
                     f"{v['max']:.3f}), {g[side]['tokens_per_s']:,.0f} tok/s (all seeds' steps)")
    opt = g["runs"][0]["optimizer"]
    lines.append(f"optimizer on this CPU: ember {opt['ember']}, nanoGPT {opt['nanogpt']} (nanoGPT fuses only on CUDA)")
    lines.append(f"speed ratio ember / nanoGPT {g['speed_ratio']:.2f}x (target >= {TARGETS['gpt']}x: "
                 f"{'met' if g['speed_met'] else 'NOT met'}); held-out loss ember - nanoGPT per seed "
                 f"{', '.join(f'{d:+.3f}' for d in g['loss_diff'])}")
    if b is None:
        return lines
    bs, e, t = b["shape"], b["run"]["ember"], b["run"]["transformers"]
    lines += ["", f"BERT MLM {bs['layers']} x {bs['hidden']} (transformers: GELU MLP {bs['mlp']}; ember: GeGLU "
              f"{bs['mlp'] // 2}, sparse prediction), seq {bs['seq']}, batch {bs['batch']}, vocab {b['vocab']}, "
              f"mask rate {b['mlm_rate']}, {b['steps']} steps, seed {b['run']['seed']}; params ember "
              f"{b['run']['params']['ember'] / 1e6:.2f}M, transformers {b['run']['params']['transformers'] / 1e6:.2f}M",
              f"{'':>14}{'tok/s':>10}{'seconds':>10}{'val loss':>10}",
              f"{'ember':>14}{e['tokens_per_s']:>10,.0f}{e['seconds']:>10.1f}{e['val_loss']:>10.3f}",
              f"{'transformers':>14}{t['tokens_per_s']:>10,.0f}{t['seconds']:>10.1f}{t['val_loss']:>10.3f}",
              f"optimizer on this CPU: ember {b['run']['optimizer']['ember']}, transformers Trainer "
              f"{b['run']['optimizer']['transformers']} (its default)",
              f"speed ratio ember / transformers Trainer {b['speed_ratio']:.2f}x (target >= {TARGETS['bert']}x: "
              f"{'met' if b['speed_met'] else 'NOT met'})"]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("default", "small"), default="default", help="GPT shape")
    parser.add_argument("--steps", type=int, default=40, help="GPT steps per side and seed")
    parser.add_argument("--bert-steps", type=int, default=30, help="0: the GPT comparison only")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-rows", type=int, default=64)
    parser.add_argument("--set", action="append", default=[], help="an ember config override for the GPT runs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (default 1: on a shared machine two threads on two busy "
                             "cores wait on each other at every op)")
    parser.add_argument("--work", type=Path, help="folder for data and runs (default: a temp dir)")
    parser.add_argument("--dry-run", action="store_true", help="toy shapes, a few steps")
    parser.add_argument("--out", type=Path, help="write the report here")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(args.threads)
    load_start = "/".join(f"{x:.1f}" for x in os.getloadavg())
    dry = args.dry_run
    gs, bs = GPT_SHAPES["dry" if dry else args.shape], BERT_SHAPES["dry" if dry else "default"]
    steps, bert_steps = (6, min(6, args.bert_steps)) if dry else (args.steps, args.bert_steps)
    work = args.work or Path(tempfile.mkdtemp(prefix="ember-vs-nanogpt-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(dir=work, prefix="runs-"))
    gdata, gman = prepared(work, "bpe", gs["vocab"], gs["seq"], dry)
    gval = eval_rows(gdata, gman, 8 if dry else args.eval_rows)
    gpt_runs = []
    for seed in range(args.seeds):
        gpt_runs.append(gpt_seed(gdata, gman, gs, steps, seed, runs, gval, args.set))
        r = gpt_runs[-1]
        print(f"gpt seed {seed}: ember {r['ember']['tokens_per_s']:,.0f} tok/s val {r['ember']['val_loss']:.3f} | "
              f"nanoGPT {r['nanogpt']['tokens_per_s']:,.0f} tok/s val {r['nanogpt']['val_loss']:.3f}", flush=True)
    gpt = {"shape": gs, "steps": steps, "vocab": gman["vocab_size"], "runs": gpt_runs,
           "eval_tokens": int(gval.numel() - len(gval))}
    for side in ("ember", "nanogpt"):
        seconds = [t for r in gpt_runs for t in r[side]["steady"]]
        gpt[side] = {"val_loss": spread([r[side]["val_loss"] for r in gpt_runs]),
                     "tokens_per_s": len(seconds) * gs["batch"] * gs["seq"] / sum(seconds)}
    gpt["speed_ratio"] = gpt["ember"]["tokens_per_s"] / gpt["nanogpt"]["tokens_per_s"]
    gpt["speed_met"] = gpt["speed_ratio"] >= TARGETS["gpt"]
    gpt["loss_diff"] = [r["ember"]["val_loss"] - r["nanogpt"]["val_loss"] for r in gpt_runs]

    bert, bert_runs = None, []
    if bert_steps > 0:
        bdata, bman = prepared(work, "wordpiece", bs["vocab"], bs["seq"], dry)
        bval = eval_rows(bdata, bman, 16 if dry else args.eval_rows)
        run = bert_pair(bdata, bman, bs, bert_steps, 0, runs, bval)
        print(f"bert: ember {run['ember']['tokens_per_s']:,.0f} tok/s val {run['ember']['val_loss']:.3f} | "
              f"transformers {run['transformers']['tokens_per_s']:,.0f} tok/s val "
              f"{run['transformers']['val_loss']:.3f}", flush=True)
        ratio = run["ember"]["tokens_per_s"] / run["transformers"]["tokens_per_s"]
        bert = {"shape": bs, "steps": bert_steps, "vocab": bman["vocab_size"], "mlm_rate": run["mlm_rate"],
                "run": run, "speed_ratio": ratio, "speed_met": ratio >= TARGETS["bert"]}
        bert_runs = [run]
    result = {"date": datetime.date.today().isoformat(), "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
              "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "command": " ".join(["python", "benchmarks/vs_nanogpt.py"]
                                                                       + sys.argv[1:]),
              "dry_run": dry, "load_start": load_start, "load_end": "/".join(f"{x:.1f}" for x in os.getloadavg()),
              "gpt": gpt, "bert": bert, "targets": TARGETS}
    finite = all(math.isfinite(r[side][key]) for r in gpt_runs + bert_runs for side in r["params"]
                 for key in ("val_loss", "tokens_per_s"))
    lines = summary(result)
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
