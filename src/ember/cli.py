"""The `ember` command. Thin: it parses arguments and calls one function per verb.

A user's mistake ends with one sentence on stderr and exit status 2; an interrupted
training run saves a checkpoint and exits with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

from ember.config import ConfigError
from ember.process import leave, under_torchrun


def _cmd_train(args) -> int:
    from ember.config import load_config
    from ember.train.trainer import Trainer

    # --budget replaces the recipe's before the recipe is checked, so it also mends a bad one.
    budget = [f"train.budget={args.budget}"] if args.budget else []
    config = load_config(args.config, [*(args.set or []), *budget])
    trainer = Trainer(config, Path(args.data), Path(args.out), budget=args.budget,
                      resume=args.resume, progress=not args.quiet)
    args.training_began = True  # what an interrupt from here on leaves is a run to resume
    summary = trainer.run()
    trainer.close()
    if trainer.rank == 0:  # under torchrun, one summary for the whole run
        _print_summary(summary)
    if summary["status"] == "already finished":
        if trainer.rank == 0:
            print("the run had already reached its budget, so nothing was changed; give a larger --budget "
                  "with --resume to train further", file=sys.stderr)
        return 0
    if summary["status"] == "interrupted":
        if trainer.rank == 0:  # once for the run, not once per rank
            print("stopped early; continue with the same command and --resume", file=sys.stderr)
        return 128 + (signal.SIGINT if trainer.stopped_by is None else trainer.stopped_by)
    if summary["status"] == "stopped on a loss spike":
        print("the loss spiked or stopped being finite (metrics.jsonl says where); the newest checkpoint "
              "before it is intact, so --resume continues from there", file=sys.stderr)
        return 1
    return 0


def _print_summary(s: dict) -> None:
    lines = [f"{s['status']} after {s['steps']:,} steps, {s['tokens']:,} tokens, {s['elapsed_s']:.0f}s on {s['device']}",
             f"  train loss {_loss(s['train_loss'])}   held-out loss {_loss(s['val_loss'])}"]
    if s.get("val_step") is not None and s["val_step"] != s["steps"]:  # an interrupted run's last evaluation
        lines[-1] += f" (at step {s['val_step']:,})"
    if s.get("unigram_entropy"):
        lines[-1] += f"   (unigram baseline {s['unigram_entropy']:.4f})"
    lines.append(f"  {s['tokens_per_s']:,.0f} tokens/s   run directory {s['run_dir']}")
    print("\n".join(lines))


def _loss(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"  # None or NaN: never measured


def _measure_host_blocks(device, iters: int) -> dict:
    from ember.tune.host_cost import sharded_block_host, split_block_host

    return {"tp": split_block_host(device, iters), "sharded": sharded_block_host(device, iters)}


def _model_block_step(model, micro_batch: int, seq: int, device, dtype):
    from ember.tune.host_cost import model_block_step

    return model_block_step(model, micro_batch, seq, device, dtype)


def _cmd_report(args) -> int:
    from ember.report import plot, summary_text

    run_dir = Path(args.run_dir)
    text = summary_text(run_dir)
    pngs = plot(run_dir)
    print(text)
    print("plots      " + ", ".join(str(p) for p in pngs))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's refusals as every other refusal of ember's: one sentence and exit status 2,
    without its usage block (the verb's --help has it). Every verb's parser is one of these:
    add_subparsers makes its parsers of the parent's class."""

    def error(self, message: str):
        self.exit(2, f"ember: error: {message} (see `{self.prog} --help`).\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ember", description="Pretrain transformer language models.")
    verbs = parser.add_subparsers(dest="verb", required=True)

    from ember.data.command import register_data
    register_data(verbs)

    train = verbs.add_parser("train", help="train a model on prepared data")
    train.add_argument("config", help="TOML recipe, e.g. configs/cram-bert.toml")
    train.add_argument("--data", required=True, help="folder written by `ember data prepare`")
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument("--budget", help="10m, 2h, 1e8tok or 500steps (overrides train.budget)")
    train.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config value")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train)

    # Verbs that live beside their code register themselves here, one line each.
    from ember.eval.command import register_eval
    from ember.export.command import register_export
    from ember.plan.command import register_plan
    from ember.tune.command import register_tune
    from ember.tune.bench import register_bench
    register_bench(verbs)
    register_eval(verbs)
    register_export(verbs)
    register_plan(verbs, measure_host_blocks=_measure_host_blocks, block_step=_model_block_step)
    register_tune(verbs)

    report = verbs.add_parser("report", help="plots and a summary of a run")
    report.add_argument("run_dir")
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
    except SystemExit as stop:  # SIGTERM unwound (status 143)
        if not under_torchrun():
            raise
        code = stop.code if isinstance(stop.code, int) else 1
    if under_torchrun():
        leave(code)  # without interpreter finalization, where gloo can abort a finished run
    return code


def _negative_values_joined(argv: list[str]) -> list[str]:
    """`--budget -5m` as `--budget=-5m`: argparse takes any word starting with "-" that is
    not a plain number for an option, and would answer with its usage instead of the
    value's own check."""
    out: list[str] = []
    for word in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(_negative_values_joined(sys.argv[1:] if argv is None else argv))
    from ember.data import DataError

    from ember.process import sigterm_unwinds

    try:
        with sigterm_unwinds():  # a scheduler's cancel unwinds as Ctrl-C does: temporary files are removed
            return args.func(args)
    except (ConfigError, DataError) as err:
        print(f"ember: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of our output went away (`ember report RUN | head`): as any Unix filter,
        # end quietly; stdout goes to /dev/null so that flushing it at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:
        # A path given on the command line cannot be read or written (a missing folder, a
        # file where a folder should be, no permission, a full disk).
        name = str(err.filename or "")
        name = name[:-4] if name.endswith(".tmp") else name  # the atomic writer's temporary name
        if isinstance(err, (FileExistsError, NotADirectoryError)) and Path(name).is_file():
            print(f"ember: error: cannot use {name} as a folder: it is a file.", file=sys.stderr)
            return 2
        print(f"ember: error: cannot use {name or 'a file'} ({err.strerror or err}).", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training's own handler is installed, or in a verb without one
        print(f"ember: interrupted; {_after_interrupt(args)}", file=sys.stderr)
        return 128 + signal.SIGINT
    except SystemExit as stop:  # SIGTERM, unwound by process.sigterm_unwinds, says the same as Ctrl-C
        if stop.code == 128 + signal.SIGTERM:
            print(f"ember: terminated; {_after_interrupt(args)}", file=sys.stderr)
        raise


def _after_interrupt(args) -> str:
    if args.verb == "train" and not getattr(args, "training_began", False):
        # Under torchrun, the peers of a rank that refused its input are stopped here.
        return "training had not begun, so nothing was changed"
    if args.verb == "train":
        return "what was written so far is complete; the same command with --resume continues the run"
    if args.verb == "data" and getattr(args, "data_verb", None) == "prepare":
        return "what was written so far is complete; the same command continues the preparation"
    return "nothing half-written was left"


if __name__ == "__main__":
    raise SystemExit(main())
