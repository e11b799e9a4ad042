"""ember against Hugging Face `transformers`, side by side, on the same device.

For each model family (a Cramming BERT against `BertForMaskedLM`, GPT-2 against
`GPT2LMHeadModel`, Llama against `LlamaForCausalLM`) both models have the same size and
are trained on the same shards by ember's own training step (so data order, masking,
optimizer, schedule and evaluation are identical) for the same training time, stepping
in alternation so that both see the same machine. Only the model differs. Prints steady-state tokens/s and held-out loss of each and the
ratio, and writes the numbers to benchmarks/results/.

    python benchmarks/vs_transformers.py --device auto --seconds 60
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.config import load_config
from ember.data.corpus import write_stdlib_corpus
from ember.data.prepare import prepare
from ember.device import device_name, pick_device
from ember.train.schedule import lr_factor
from ember.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 3  # excluded from tokens/s: allocation, autotuning, compilation

# (family, ember recipe, tokenizer, the shape on a CPU, the shape on a GPU)
FAMILIES = {
    "bert": ("cram-bert.toml", "wordpiece",
             dict(hidden=256, layers=4, heads=4, mlp=1024, seq=128, mb=32, vocab=8192),
             dict(hidden=768, layers=16, heads=12, mlp=3072, seq=128, mb=128, vocab=32768)),
    "gpt2": ("gpt2-small.toml", "bpe",
             dict(hidden=256, layers=4, heads=4, mlp=1024, seq=128, mb=16, vocab=8192),
             dict(hidden=768, layers=12, heads=12, mlp=3072, seq=1024, mb=16, vocab=32768)),
    "llama": ("llama-1b.toml", "bpe",
              dict(hidden=256, layers=4, heads=4, mlp=688, seq=128, mb=16, vocab=8192),
              dict(hidden=2048, layers=8, heads=16, mlp=5632, seq=1024, mb=8, vocab=32768)),
}


class HFLossAdapter(torch.nn.Module):
    """Gives a transformers model ember's forward(input_ids, labels, reduction)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, labels=None, reduction="mean"):
        logits = self.hf(input_ids=input_ids).logits
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction=reduction)


def hf_model(family: str, s: dict, padded_vocab: int):
    import transformers as tf

    common = dict(attn_implementation="sdpa")
    if family == "bert":
        cfg = tf.BertConfig(vocab_size=padded_vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                            num_attention_heads=s["heads"], intermediate_size=s["mlp"],
                            max_position_embeddings=s["seq"], hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **common)
        return tf.BertForMaskedLM(cfg)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=padded_vocab, n_positions=s["seq"], n_embd=s["hidden"], n_layer=s["layers"],
                            n_head=s["heads"], n_inner=s["mlp"], resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.LlamaConfig(vocab_size=padded_vocab, hidden_size=s["hidden"], intermediate_size=s["mlp"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["heads"], max_position_embeddings=s["seq"],
                         tie_word_embeddings=False, **common)
    return tf.LlamaForCausalLM(cfg)


def ember_overrides(family: str, s: dict, args) -> list[str]:
    # Cramming's GeGLU splits its 4h projection into gate and value halves: the same
    # parameter count as BERT's GELU MLP of width 4h.
    mlp = s["mlp"] // 2 if family == "bert" else s["mlp"]
    return [f"model.hidden={s['hidden']}", f"model.layers={s['layers']}", f"model.heads={s['heads']}",
            f"model.mlp_hidden={mlp}", f"model.max_seq_len={s['seq']}", "model.vocab_size=0",
            f"train.micro_batch={s['mb']}", f"train.global_batch={s['mb']}", "train.log_every=5",
            "train.eval_every=100000steps", "train.eval_batches=4", "train.checkpoint_every=100000steps",
            "schedule.lr=constant", "schedule.warmup=0.05", "schedule.batch_start=0",
            "train.compile=false", f"train.device={args.device}"]  # --compile: compile_layers, both sides


def compile_layers(model: torch.nn.Module) -> int:
    """torch.compile each transformer layer of either model the same way: the elements of
    its largest nn.ModuleList (ember's blocks, BERT's encoder.layer, GPT-2's h, Llama's
    layers). Returns how many were compiled."""
    lists = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    layers = max(lists, key=len)
    for layer in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers):
        layer.forward = torch.compile(layer.forward)
    return len(layers)


def train_pair(family, data_dir, run_dir, overrides, seconds, models: dict) -> dict:
    """Train the models in alternation, always stepping the one that has used less time,
    until each has trained `seconds`: both see the same machine conditions, so a noisy
    neighbour slows both instead of biasing the ratio. Steps are ember's own train_step."""
    cfg = load_config(REPO / "configs" / FAMILIES[family][0], overrides)
    trainers = {}
    for name, model in models.items():
        trainers[name] = Trainer(cfg, data_dir, Path(run_dir) / name, progress=False, model=model)
        trainers[name].build()
    used = {name: 0.0 for name in models}
    steady = {name: [0.0, 0] for name in models}  # seconds and tokens after warm-up
    steps = {name: 0 for name in models}
    tokens_per_step = cfg.train.global_batch * trainers[next(iter(models))].seq_len
    while min(used.values()) < seconds:
        name = min(used, key=used.get)
        trainer = trainers[name]
        lr = cfg.optim.lr * lr_factor(used[name] / seconds, cfg.schedule)
        start = time.perf_counter()
        loss, _, _ = trainer.train_step(cfg.train.global_batch, lr)
        float(loss)  # waits for the device, so the step is timed whole
        elapsed = time.perf_counter() - start
        used[name] += elapsed
        steps[name] += 1
        if steps[name] > WARMUP_STEPS:
            steady[name][0] += elapsed
            steady[name][1] += tokens_per_step
    out = {}
    for name, trainer in trainers.items():
        seconds_, tokens = steady[name]
        out[name] = {"tokens_per_s": tokens / seconds_ if seconds_ else None, "val_loss": trainer.evaluate(),
                     "steps": steps[name], "tokens": steps[name] * tokens_per_step,
                     "params": sum(p.numel() for p in trainer.model.parameters())}  # tied weights once
        rate = out[name]["tokens_per_s"]
        flops = trainer.flops_per_token(cfg.data.mlm_rate if cfg.model.objective == "mlm" else 1.0)
        out[name]["mfu"] = rate * flops / trainer.peak if (trainer.peak and rate) else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="bert,gpt2,llama")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time of each model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--work", default=None, help="folder for data and runs (default: a temp dir)")
    parser.add_argument("--out", default=None, help="JSON results file (default: benchmarks/results/...)")
    args = parser.parse_args()
    import transformers

    device = pick_device(args.device)
    on_gpu = device.type == "cuda"
    work = Path(args.work or tempfile.mkdtemp(prefix="ember-bench-"))
    corpus = work / "stdlib.jsonl"
    if not corpus.exists():
        write_stdlib_corpus(corpus)
    runs = Path(tempfile.mkdtemp(dir=work, prefix="runs-"))  # data is reused, runs never are
    rows = []
    for family in args.families.split(","):
        recipe, tokenizer, cpu_shape, gpu_shape = FAMILIES[family]
        shape = gpu_shape if on_gpu else cpu_shape
        data_dir = work / f"data-{tokenizer}-{shape['vocab']}-{shape['seq']}"
        if not (data_dir / "manifest.json").exists():
            prepare([corpus], data_dir, tokenizer=tokenizer, vocab_size=shape["vocab"], seq_len=shape["seq"],
                    val_fraction=0.02, progress=False)
        overrides = ember_overrides(family, shape, args)
        cfg = load_config(REPO / "configs" / recipe, overrides)
        vocab = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
        padded = -(-vocab // cfg.model.vocab_multiple) * cfg.model.vocab_multiple
        torch.manual_seed(0)
        from ember.model import Transformer

        cfg.model.vocab_size = vocab
        ember_model = Transformer(cfg.model)
        torch.manual_seed(0)
        peer = HFLossAdapter(hf_model(family, shape, padded))
        if args.compile:
            compiled = {compile_layers(ember_model), compile_layers(peer)}
            if len(compiled) != 1:
                raise SystemExit(f"{family}: the two models compiled {sorted(compiled)} layers; expected the same")
        result = train_pair(family, data_dir, runs / family, overrides, args.seconds,
                            {"ember": ember_model, "transformers": peer})
        ours, theirs = result["ember"], result["transformers"]
        row = {"family": family, "shape": shape, "ember": ours, "transformers": theirs,
               "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"]
               if ours["tokens_per_s"] and theirs["tokens_per_s"] else None}
        rows.append(row)
        if row["speedup"] is None:
            raise SystemExit(f"{family}: too few steps to time; raise --seconds")
        print(f"{family:6s} ember {ours['tokens_per_s']:>10,.0f} tok/s  val {ours['val_loss']:.3f}  "
              f"({ours['params'] / 1e6:.1f}M params) | transformers {theirs['tokens_per_s']:>10,.0f} tok/s  "
              f"val {theirs['val_loss']:.3f}  ({theirs['params'] / 1e6:.1f}M) | speed ratio {row['speedup']:.2f}x",
              flush=True)
        del ember_model, peer
        if on_gpu:
            torch.cuda.empty_cache()

    result = {
        "date": datetime.date.today().isoformat(), "device": device_name(device),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "seconds_per_run": args.seconds, "compile": args.compile, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(), "results": rows,
    }
    out = Path(args.out) if args.out else (
        REPO / "benchmarks" / "results" / f"{result['date']}-vs-transformers-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
