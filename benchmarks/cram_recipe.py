"""The Cramming recipe for a given budget, against a Hugging Face BERT baseline.

Runs `configs/cram-bert.toml` as it is (budget triangle, batch ramp, sparse prediction)
through `ember train`'s trainer for `--budget`, then `BertForMaskedLM` of the same size
through the same trainer, data, masks, optimizer and schedule for the same budget, and
prints masked-LM held-out loss over time and tokens/s of both. Meant for a GPU (e.g.
`--budget 20m`); on a CPU scale the model down with --set.

    python benchmarks/cram_recipe.py --budget 20m
    python benchmarks/cram_recipe.py --budget 2m --set model.layers=4 --set model.hidden=256 \\
        --set model.heads=4 --set model.mlp_hidden=512 --set train.micro_batch=32 \\
        --set train.global_batch=256 --set schedule.batch_start=32
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from ember.config import load_config
from ember.data.corpus import write_stdlib_corpus
from ember.data.prepare import prepare
from ember.device import device_name, pick_device
from ember.train.trainer import Trainer
from vs_transformers import HFLossAdapter, hf_model

REPO = Path(__file__).resolve().parents[1]


def curve(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    return {"val": [(r["elapsed_s"], r["val_loss"]) for r in lines if "val_loss" in r],
            "train": [(r["elapsed_s"], r["loss"]) for r in train],
            "tokens_per_s": sorted(r["tokens_per_s"] for r in train[1:])[len(train[1:]) // 2] if len(train) > 1 else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="20m")
    parser.add_argument("--data", help="prepared WordPiece data (default: the stdlib corpus, vocab 32768)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="ember-cram-"))
    data = Path(args.data) if args.data else work / "data-wordpiece"
    if not (data / "manifest.json").exists():
        write_stdlib_corpus(work / "stdlib.jsonl")
        prepare([work / "stdlib.jsonl"], data, tokenizer="wordpiece", vocab_size=32768, seq_len=128,
                val_fraction=0.02, progress=False)
    overrides = ["model.vocab_size=0", "train.eval_every=2m", "train.checkpoint_every=100000steps",
                 "train.log_every=5", *args.set]
    runs = Path(tempfile.mkdtemp(dir=work, prefix="runs-"))
    cfg = load_config(REPO / "configs/cram-bert.toml", overrides)
    ember = Trainer(cfg, data, runs / "ember", budget=args.budget, progress=False)
    ember.run()
    m = ember.cfg.model  # vocabulary resolved from the data
    shape = {"hidden": m.hidden, "layers": m.layers, "heads": m.heads, "mlp": 2 * m.mlp_hidden, "seq": m.max_seq_len}
    torch.manual_seed(0)
    peer = HFLossAdapter(hf_model("bert", shape, m.padded_vocab))
    Trainer(load_config(REPO / "configs/cram-bert.toml", overrides), data, runs / "transformers",
            budget=args.budget, progress=False, model=peer).run()

    result = {"date": datetime.date.today().isoformat(), "device": device_name(pick_device(cfg.train.device)),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "budget": args.budget,
              "torch": torch.__version__, "shape": shape,
              "ember": curve(runs / "ember"), "transformers": curve(runs / "transformers")}
    for name in ("ember", "transformers"):
        r = result[name]
        vals = "  ".join(f"{t:.0f}s:{v:.3f}" for t, v in r["val"])
        print(f"{name:12s} {r['tokens_per_s']:>10,.0f} tok/s   held-out MLM loss over time  {vals}")
    ratio = result["ember"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    print(f"speed ratio {ratio:.2f}x")
    out = Path(args.out) if args.out else REPO / "benchmarks/results" / f"{result['date']}-cram-recipe.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
