"""The `ember eval` verbs: `glue` and `lm`. Heavy imports wait until a verb runs, so
that `ember --help` stays fast."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _cmd_glue(args) -> int:
    from rich.console import Console

    from ember.config import ConfigError
    from ember.eval.finetune import Protocol
    from ember.eval.glue import results_table, run_glue

    lr = Protocol.lr if args.lr is None else args.lr
    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"--lr must be positive and finite, not {args.lr}.")
    results = run_glue(args.checkpoint, args.glue_dir, tasks=args.tasks, seeds=args.seeds,
                       tokenizer=args.tokenizer, out=args.out, device=args.device, progress=not args.quiet,
                       jobs=args.jobs, protocol=Protocol(lr=lr, pooling=args.pooling))
    console = Console()
    console.print(results_table(results))
    console.print(f"results written to {results['path']}")
    return 0


def _cmd_lm(args) -> int:
    from ember.atomic import write_text
    from ember.data import load_manifest
    from ember.eval.lm import check_data, evaluate_lm
    from ember.eval.results import check_lm_data, claim
    from ember.config import ConfigError
    from ember.eval.run import open_run

    if any(value is not None and value < 1 for value in (args.batches, args.batch_size)):
        raise ConfigError("--batches and --batch-size must be at least 1.")
    run = open_run(args.checkpoint)
    manifest = load_manifest(Path(args.data))
    check_data(run, manifest, Path(args.data))  # the inputs first, then where results go
    out = Path(args.out) if args.out else run.result_path("eval", "lm")
    earlier = claim(out, run.run_dir, "lm")
    if earlier is not None:
        held_out = manifest["splits"]["val"]["sequences"]
        per_batch = run.config.train.micro_batch if args.batch_size is None else args.batch_size
        scored = held_out if args.batches is None else min(held_out, args.batches * max(per_batch, 0))
        check_lm_data(out, earlier, run.weights, Path(args.data), scored)
    result = evaluate_lm(run, args.data, batches=args.batches, batch_size=args.batch_size, device=args.device)
    what = "masked-token" if result["objective"] == "mlm" else "next-token"
    line = (f"held-out loss {result['loss']:.4f}   perplexity {result['perplexity']:,.2f}   "
            f"{what} accuracy {100 * result['accuracy']:.2f}%   "
            f"({result['targets']:,} targets in {result['sequences']:,} sequences)")
    if result["unigram_entropy"]:
        line += f"\n  unigram baseline {result['unigram_entropy']:.4f}"
    print(line)
    write_text(out, json.dumps(result, indent=1))
    print(f"written to {out}")
    return 0


def register_eval(verbs) -> None:
    """Add `ember eval glue` and `ember eval lm` to the top-level subparsers."""
    evals = verbs.add_parser("eval", help="evaluate a trained run").add_subparsers(dest="eval_verb", required=True)

    glue = evals.add_parser("glue", help="fine-tune on GLUE tasks (Cramming's protocol) and report dev scores")
    glue.add_argument("--checkpoint", required=True, help="run directory (or one of its checkpoints/step_* folders)")
    glue.add_argument("--glue-dir", required=True, help="the unpacked GLUE data: CoLA/, SST-2/, MRPC/, ...")
    glue.add_argument("--tasks", help="comma-separated: cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte (default: all)")
    glue.add_argument("--seeds", type=int, default=5, help="fine-tuning runs per task; the median is reported")
    glue.add_argument("--tokenizer", help="tokenizer.json (default: the one in the run directory)")
    glue.add_argument("--out", help="results file (.json) or folder (default: RUN_DIR/eval/glue/results.json; "
                           "results_step_N.json for a checkpoint)")
    glue.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    glue.add_argument("--jobs", type=int, default=1,
                      help="fine-tuning runs (tasks x seeds) at once, in processes on the CPU, each with "
                           "cores/jobs threads (default 1)")
    glue.add_argument("--lr", type=float, help="peak fine-tuning learning rate (default: the protocol's 4e-5)")
    glue.add_argument("--pooling", choices=("auto", "mean"), default="auto",
                      help="auto: first token of a masked LM, last of a causal LM; mean: average of all tokens")
    glue.add_argument("--quiet", action="store_true", help="no progress (bars in a terminal, lines elsewhere)")
    glue.set_defaults(func=_cmd_glue)

    lm = evals.add_parser("lm", help="held-out loss, perplexity and token accuracy on prepared data")
    lm.add_argument("--checkpoint", required=True, help="run directory (or one of its checkpoints/step_* folders)")
    lm.add_argument("--data", required=True, help="folder written by `ember data prepare` (its val split is used)")
    lm.add_argument("--batches", type=int, help="score only this many batches (default: the whole val split)")
    lm.add_argument("--batch-size", type=int, help="sequences per batch (default: the run's train.micro_batch)")
    lm.add_argument("--out", help="JSON file for the numbers (default: RUN_DIR/eval/lm.json; "
                                        "lm_step_N.json for a checkpoint)")
    lm.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    lm.set_defaults(func=_cmd_lm)
